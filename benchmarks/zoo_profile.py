"""Kernel-by-kernel profile of the tctune backend against Inductor on zoo models: where the time goes on the GPU.

Usage::

    python benchmarks/zoo_profile.py --models MT5ForConditionalGeneration,swin_t --out $OUT/prof \\
        --budget-s 560 --model-timeout 150                        # one ten-minute GPU call, one model at a time
    python benchmarks/zoo_profile.py --models DistilBertForMaskedLM --tiny --device cpu --out /tmp/p  # CPU dry run
    python benchmarks/zoo_profile.py --table DIR                 # rebuild DIR/profile.md from DIR/*/profile.json
    python benchmarks/zoo_profile.py --recipe recipes/gpt2.py --batch 128 --dtype fp16 --inductor-mode \
        reduce-overhead --tctune-options '{"precision": "fp8", "mode": "reduce-overhead"}' --out $OUT/prof
        # a model file against a plain baseline of its own choosing (here tctune optimize's GPT-2 answer)

Per model, in its own process (``--model-timeout`` seconds, killed with its process group after that; fresh
Inductor / Triton cache folders), built by ``benchmarks/zoo.py`` (imported as module ``tctune_bench_zoo``: same
configs, random weights, batch sizes ``--scale``, seeded inputs), in ``torch.no_grad``, the two variants the zoo
times, compiled the way ``zoo.py`` compiles them and in its order:

=============  ==========================================================================================
``tctune``     ``torch.compile(fp32 model, backend="tctune", options={"precision": dt, "policy": "pure",
               "output_dtype": "compute"})``: outputs left in dt like the Inductor side's (zoo's contract)
``inductor``   ``torch.compile(copy.deepcopy(model).to(dt))``, floating inputs cast to dt
=============  ==========================================================================================

Before both, a tiny unrelated function is compiled with Inductor (``warm_compile_s``): the one-off costs of a
process's first compile (Inductor's compile worker pool, Triton and C++ toolchain checks) would otherwise be
charged to whichever side compiles first (``zoo.py``'s tctune). Each side: compile seconds (wall time of the
first call; the backend's per-stage seconds from its ``SubgraphReport.seconds`` and per-pass seconds from its
``pass_seconds``, summed over subgraphs), ``--warmup`` more calls, the wall time per call over ``--iters``
calls (CUDA events, ``time.perf_counter`` on the CPU; the two sides timed one after the other, outside the
profiler), then ``torch.profiler`` over ``--iters`` calls: CUDA device activity (kernels, memcpy, memset; self
device time) on CUDA, CPU operators (self CPU time) on the CPU, so the script runs and is tested without a GPU.

Kernels are matched across the two sides by :func:`normalize` (Inductor names its generated Triton kernels
``triton_<kind>_fused_<ops>_<index>``, and the index differs between two compiles: it is dropped) and grouped by
:func:`kernel_category` (gemm, conv, attention, triton pointwise / reduction / persistent reduction / template,
copy/cast, memset, other).

Output, one folder per model (``/`` in a name becomes ``__``)::

    OUT/NAME/profile.json  {"name", "suite", "batch_size", "dtype", "device", "kind" ("cuda_kernels" | "cpu_ops"),
                            "iters", "status", "reason", "sides": {"inductor" | "tctune": {"compile_s", "wall_ms",
                            "kernel_us_per_iter", "launches_per_iter", "kernels": [{"name", "category", "calls",
                            "total_us", "us_per_iter", "share"}]}}, "tctune_report": {"subgraphs", "fallbacks",
                            "stage_s", "pass_s", "summaries"}, "warm_compile_s",
                            "categories": {cat: {"inductor_us", "tctune_us", "delta_us"}},
                            "top_delta": [{"name", "category", "inductor_calls", "inductor_us", "tctune_calls",
                            "tctune_us", "delta_us"}]}
    OUT/NAME/profile.md    the diff table of that model (:func:`model_markdown`)
    OUT/profile.md         a summary line per model, then every model's diff table

``calls`` and ``total_us`` are over the ``iters`` profiled calls; ``us_per_iter`` = ``total_us`` / iters;
``share`` = the kernel's fraction of its side's kernel time. Deltas are tctune - Inductor (> 0: tctune spends
more). The wall time includes launch overhead and host work that the kernel time does not.

Time limits: ``--model-timeout`` per model process, ``--budget-s`` for the whole call (no model is started with
less than ``--min-model-s`` left; the ones not started are written as ``skipped``). Sizing a ten-minute call:
each model costs two compiles (10-45 s each on an H200 host for the zoo's models) plus its profile, so ~6 models
of the zoo's mid sizes fit with ``--model-timeout 150``; ``--jobs N`` runs N model processes at once (their
compiles overlap; every timed or profiled section holds the per-GPU lock of ``zoo.gpu_timing_lock``).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchload import load_benchmark

_T0 = time.perf_counter()
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

zoo = load_benchmark("zoo")  # the same module object the tests use

SIDES = ("inductor", "tctune")
#: Kernels in the top-|delta| table of each model.
TOP = 10
#: Kernel categories in table order (:func:`kernel_category`).
CATEGORIES = ("gemm", "conv", "attention", "triton_pointwise", "triton_reduction", "triton_persistent",
              "triton_template", "triton_other", "copy_cast", "memset", "other")

_TRITON_KINDS = {"poi": "triton_pointwise", "red": "triton_reduction", "per": "triton_persistent",
                 "tem": "triton_template"}
_ATTENTION = ("flash", "fmha", "sdpa", "attention", "attn")
_CONV = ("fprop", "dgrad", "wgrad", "implicit_gemm", "conv", "winograd", "implicit_convolve")
_GEMM = ("gemm", "cutlass", "cublas", "nvjet", "xmma", "_mm_", "matmul", "addmm", "aten::mm", "aten::bmm")
_COPY = ("memcpy", "copy", "to_copy", "aten::to", "cast")
_MEMSET = ("memset", "fillfunctor", "aten::fill_", "aten::zero_")


def kernel_category(name: str) -> str:
    """The category of a profiled kernel (or, on the CPU, operator) name, first rule that matches (lower case):

    1. ``attention``: contains flash, fmha, sdpa, attention or attn (FlashAttention ``pytorch_flash::
       flash_fwd_kernel``, cuDNN's ``cudnn_generated_fort_native_sdpa...``, memory-efficient ``fmha_cutlass``);
    2. Inductor's Triton kernels, by the kind in ``triton_<kind>_...``: ``poi`` -> ``triton_pointwise``,
       ``red`` -> ``triton_reduction``, ``per`` -> ``triton_persistent`` (persistent reduction), ``tem`` ->
       ``triton_template`` (autotuned GEMM / conv templates); any other ``triton`` name -> ``triton_other``;
    3. ``conv``: fprop / dgrad / wgrad / implicit_gemm / conv / winograd (cuDNN's convolution kernels are named
       ``sm90_xmma_fprop_implicit_gemm_...``; checked before gemm for that reason);
    4. ``gemm``: gemm, cutlass, cublas, nvjet (cuBLAS's Hopper kernels), xmma, ``_mm_``, matmul, addmm and
       the CPU's ``aten::mm`` / ``aten::bmm``;
    5. ``memset``: ``Memset (Device)``, fill kernels (``FillFunctor``), ``aten::fill_`` / ``aten::zero_``;
    6. ``copy_cast``: memcpy, copy (``direct_copy_kernel_cuda``, ``copy_``), ``aten::to``, cast;
    7. ``other``.

    Args:
        name: the profiler's event key (any string).

    Returns:
        One of :data:`CATEGORIES`.
    """
    low = name.lower()
    if any(k in low for k in _ATTENTION):
        return "attention"
    m = re.match(r"triton_([a-z]+)_", low)
    if m:
        return _TRITON_KINDS.get(m.group(1), "triton_other")
    if "triton" in low:
        return "triton_other"
    for cat, keys in (("conv", _CONV), ("gemm", _GEMM), ("memset", _MEMSET), ("copy_cast", _COPY)):
        if any(k in low for k in keys):
            return cat
    return "other"


def normalize(name: str) -> str:
    """The name kernels are matched by across two compiles: a Triton kernel without its trailing
    ``_<index>`` (``triton_poi_fused__to_copy_add_17`` -> ``triton_poi_fused__to_copy_add``); on the CPU, the
    profiler's per-compile labels without their graph hash or frame id (``## Call CompiledFxGraph <hash> ##``,
    ``Torch-Compiled Region: 0/1``); other names unchanged (whitespace collapsed)."""
    name = " ".join(name.split())
    if name.startswith("triton_"):
        return re.sub(r"_\d+$", "", name)
    if name.startswith("## Call CompiledFxGraph"):
        return "## Call CompiledFxGraph ##"
    if name.startswith("Torch-Compiled Region"):
        return "Torch-Compiled Region"
    return name


# ------------------------------------------------------------------------------------------------ profile


def profile_kernels(fn, args: tuple, iters: int, cuda: bool) -> dict[str, tuple[int, float]]:
    """``torch.profiler`` over ``iters`` calls of ``fn(*args)`` (the caller warms up first).

    Returns:
        kernel name -> (calls, total self microseconds) over the ``iters`` calls: CUDA device events (kernels,
        memcpy, memset) on CUDA, CPU operators otherwise; events with no time are dropped.
    """
    return zoo.profile_by_name(fn, args, iters, cuda)


def side_summary(kernels: dict[str, tuple[int, float]], iters: int) -> dict:
    """One side of the profile: kernel time and launches per iteration, and every kernel (most time first)
    with its category, calls and total microseconds over the ``iters`` calls, microseconds per call and share."""
    total = sum(t for _, t in kernels.values())
    rows = [{"name": k, "category": kernel_category(k), "calls": c, "total_us": round(t, 2),
             "us_per_iter": round(t / iters, 2), "share": round(t / total, 5) if total else 0.0}
            for k, (c, t) in sorted(kernels.items(), key=lambda kv: (-kv[1][1], kv[0]))]
    return {"kernel_us_per_iter": round(total / iters, 2),
            "launches_per_iter": round(sum(c for c, _ in kernels.values()) / iters, 2), "kernels": rows}


def diff(ind: dict, tct: dict, iters: int, top: int = TOP) -> dict:
    """Compare two :func:`profile_kernels` results (Inductor, tctune), per iteration.

    Returns:
        ``{"categories": {cat: {"inductor_us", "tctune_us", "delta_us"}}`` (every category either side has, in
        :data:`CATEGORIES` order), ``"top_delta": [...]`` (the ``top`` normalised kernel names with the largest
        |tctune - Inductor| microseconds per call: name, category, calls per call and microseconds per call of
        each side, delta)}``.
    """
    cats: dict[str, dict[str, float]] = {}
    by_name: dict[str, dict[str, list[float]]] = {}
    for side, ks in (("inductor", ind), ("tctune", tct)):
        for k, (c, t) in ks.items():
            d = cats.setdefault(kernel_category(k), {"inductor_us": 0.0, "tctune_us": 0.0})
            d[f"{side}_us"] += t / iters
            n = by_name.setdefault(normalize(k), {"inductor": [0.0, 0.0], "tctune": [0.0, 0.0]})
            n[side][0] += c / iters
            n[side][1] += t / iters
    categories = {c: {"inductor_us": round(cats[c]["inductor_us"], 2), "tctune_us": round(cats[c]["tctune_us"], 2),
                      "delta_us": round(cats[c]["tctune_us"] - cats[c]["inductor_us"], 2)}
                  for c in CATEGORIES if c in cats}
    rows = [{"name": k, "category": kernel_category(k), "inductor_calls": round(v["inductor"][0], 2),
             "inductor_us": round(v["inductor"][1], 2), "tctune_calls": round(v["tctune"][0], 2),
             "tctune_us": round(v["tctune"][1], 2), "delta_us": round(v["tctune"][1] - v["inductor"][1], 2)}
            for k, v in by_name.items()]
    rows.sort(key=lambda r: (-abs(r["delta_us"]), r["name"]))
    return {"categories": categories, "top_delta": rows[:top]}


# ------------------------------------------------------------------------------------------------ markdown


def _f(x, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def _short(name: str, n: int = 90) -> str:
    name = name.replace("|", "\\|")
    return name if len(name) <= n else name[:n - 1] + "…"


def model_markdown(row: dict) -> str:
    """The diff table of one model's ``profile.json`` row: wall and kernel time per call of both sides, compile
    seconds, the backend's stage seconds, the per-category table and the top-|delta| kernels."""
    name = row.get("name")
    head = [f"## {name}", ""]
    if row.get("status") != "ok":
        return "\n".join(head + [f"status: {row.get('status')}: {row.get('reason', '')}", ""])
    s = row["sides"]
    i, t = s["inductor"], s["tctune"]
    unit = "GPU kernel" if row.get("kind") == "cuda_kernels" else "CPU operator self"
    ratio = i["wall_ms"] / t["wall_ms"] if i.get("wall_ms") and t.get("wall_ms") else None
    rep = row.get("tctune_report") or {}
    stages = ", ".join(f"{k} {v:.2f}" for k, v in (rep.get("stage_s") or {}).items())
    slow = sorted((rep.get("pass_s") or {}).items(), key=lambda kv: -kv[1])[:3]
    if slow:
        stages += " (slowest passes: " + ", ".join(f"{k} {v:.2f}" for k, v in slow) + ")"
    lines = head + [
        f"{row.get('suite')}, batch {row.get('batch_size')}, {row.get('dtype')}, {row.get('device')}, "
        f"{row.get('iters')} profiled calls per side ({row.get('kind')}).", "",
        "| | Inductor | tctune | tctune - Inductor |", "|---|---:|---:|---:|",
        f"| wall ms per call | {_f(i.get('wall_ms'), '.3f')} | {_f(t.get('wall_ms'), '.3f')} | "
        f"{_f(t['wall_ms'] - i['wall_ms'] if ratio else None, '+.3f')} |",
        f"| {unit} µs per call | {_f(i['kernel_us_per_iter'])} | {_f(t['kernel_us_per_iter'])} | "
        f"{_f(t['kernel_us_per_iter'] - i['kernel_us_per_iter'], '+.1f')} |",
        f"| launches per call | {_f(i['launches_per_iter'])} | {_f(t['launches_per_iter'])} | "
        f"{_f(t['launches_per_iter'] - i['launches_per_iter'], '+.1f')} |",
        f"| compile s | {_f(i.get('compile_s'), '.2f')} | {_f(t.get('compile_s'), '.2f')} | "
        f"{_f((t.get('compile_s') or 0) - (i.get('compile_s') or 0), '+.2f')} |", "",
        f"tctune / Inductor throughput (wall): {_f(ratio, '.3f')}; backend subgraphs {rep.get('subgraphs')}, "
        f"fallbacks {len(rep.get('fallbacks') or [])}; backend stage seconds (summed over subgraphs): "
        f"{stages or '–'}.", "",
        "| category | Inductor µs | tctune µs | delta µs |", "|---|---:|---:|---:|"]
    for c, d in sorted(row["categories"].items(), key=lambda kv: -abs(kv[1]["delta_us"])):
        lines.append(f"| {c} | {d['inductor_us']:.1f} | {d['tctune_us']:.1f} | {d['delta_us']:+.1f} |")
    lines += ["", f"Top {len(row['top_delta'])} kernels by |delta| (per call; Triton index suffix dropped):", "",
              "| kernel | category | Inductor calls | Inductor µs | tctune calls | tctune µs | delta µs |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in row["top_delta"]:
        lines.append(f"| `{_short(r['name'])}` | {r['category']} | {r['inductor_calls']:g} | {r['inductor_us']:.1f} "
                     f"| {r['tctune_calls']:g} | {r['tctune_us']:.1f} | {r['delta_us']:+.1f} |")
    return "\n".join(lines + [""])


def combined_markdown(rows: list[dict]) -> str:
    """``profile.md``: one summary line per model (wall ratio, kernel time per call of both sides, the category
    and the kernel with the largest |delta|), then each model's :func:`model_markdown`."""
    lines = ["# Kernel profiles: tctune backend against Inductor (zoo_profile.py)", "",
             "| model | status | tctune / Inductor (wall) | kernel µs Inductor | kernel µs tctune | "
             "largest category delta | largest kernel delta |", "|---|---|---:|---:|---:|---|---|"]
    for row in rows:
        if row.get("status") != "ok":
            lines.append(f"| {row.get('name')} | {row.get('status')} | – | – | – | – | – |")
            continue
        i, t = row["sides"]["inductor"], row["sides"]["tctune"]
        ratio = i["wall_ms"] / t["wall_ms"] if i.get("wall_ms") and t.get("wall_ms") else None
        cat = max(row["categories"].items(), key=lambda kv: abs(kv[1]["delta_us"]), default=None)
        k = row["top_delta"][0] if row["top_delta"] else None
        cat_s = f"{cat[0]} {cat[1]['delta_us']:+.1f}" if cat else "–"
        k_s = f"`{_short(k['name'], 60)}` {k['delta_us']:+.1f}" if k else "–"
        lines.append(f"| {row['name']} | ok | {_f(ratio, '.3f')} | {i['kernel_us_per_iter']:.1f} | "
                     f"{t['kernel_us_per_iter']:.1f} | {cat_s} | {k_s} |")
    return "\n".join(lines + [""] + [model_markdown(r) for r in rows])


# ------------------------------------------------------------------------------------------------ one model


def model_dir(out: Path, name: str) -> Path:
    return Path(out) / name.replace("/", "__")


def _save(out: Path, row: dict) -> None:
    d = model_dir(out, row["name"])
    zoo._write_json(d / "profile.json", row)
    (d / "profile.md").write_text(model_markdown(row))


def recipe_entry(path: str | Path):
    """A zoo-like entry for a model file (``build_model()`` / ``example_inputs(batch)``, as ``tctune optimize``
    reads it): named ``recipe-<file stem>``, suite ``recipe``, default batch 8 (``--batch`` sets it)."""
    return zoo.Entry(f"recipe-{Path(path).stem}", "recipe", 8)


def _recipe_built(entry, device: str):
    """Build the model file ``--recipe`` named (``entry`` from :func:`recipe_entry`): FP32, eval, on ``device``;
    its inputs from ``example_inputs(batch)`` moved to ``device`` (the seed argument of ``make_inputs`` re-seeds
    torch before each call)."""
    import torch

    from tctune.modelfile import load_model_file

    mf = load_model_file(_RECIPES[entry.name])
    model = mf.build_model().eval().to(device)

    def make(batch, dev, seed):
        torch.manual_seed(seed)
        return tuple(x.to(dev) for x in mf.inputs(batch))

    return zoo.Built(model, make, f"{mf.path.name}: example_inputs(B)",
                     params=sum(p.numel() for p in model.parameters()), note=str(mf.path))


#: ``recipe-<stem>`` -> the model file's path, for the worker process (filled from ``--recipe``).
_RECIPES: dict[str, str] = {}


def profile_model(entry, args: argparse.Namespace) -> dict:
    """Build ``entry``, compile both sides, time and profile them (module docstring); rewrites the model's
    ``profile.json`` after each step, so a killed process keeps what it finished."""
    import torch

    import tctune.backend as tb

    cuda = args.device.startswith("cuda")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    batch = args.batch or zoo.scaled_batch(entry.batch_size, args.scale)
    lock = os.environ.get("ZOO_GPU_LOCK") or None
    waits: list[float] = []
    row: dict = {"name": entry.name, "suite": entry.suite, "batch_size": batch, "dtype": args.dtype,
                 "device": args.device, "tiny": bool(args.tiny), "kind": "cuda_kernels" if cuda else "cpu_ops",
                 "iters": args.iters, "warmup": args.warmup, "status": "running", "current": "build", "sides": {},
                 "started": _dt.datetime.now().isoformat(timespec="seconds"), "env": zoo._env()}
    save = lambda: _save(args.out, row)  # noqa: E731
    save()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        torch.manual_seed(0)
        built = _recipe_built(entry, args.device) if entry.suite == "recipe" else zoo.build(
            entry, args.tiny, args.seq, args.device)
    except Exception as exc:  # noqa: BLE001 - recorded
        row.update(status="not_built", reason=zoo.one_line(exc))
        save()
        return row
    inputs = built.make_inputs(batch, args.device, 1234)
    low_inputs = tuple(x.to(dt) if x.is_floating_point() else x for x in inputs)
    row.update(params=built.params, inputs=built.desc)
    backend = "tctune" if "tctune" in torch._dynamo.list_backends() else tb.tctune_backend
    options = {"precision": args.dtype, "policy": "pure", "output_dtype": zoo.TCTUNE_OUTPUT_DTYPE,
               **json.loads(args.tctune_options or "{}")}
    row["output_dtype"] = zoo.TCTUNE_OUTPUT_DTYPE
    row["tctune_options"] = options
    row["inductor_mode"] = args.inductor_mode
    fns: dict = {}
    with torch.no_grad():
        # One-off costs of the process's first Inductor compile (compile worker pool, Triton / C++ toolchain
        # checks) are paid here, so neither side's compile seconds carry them.
        row["current"] = "warm-up compile"
        save()
        t = time.perf_counter()
        x = torch.randn(64, device=args.device)
        torch.compile(lambda v: (v * 2).sin() + 1)(x)
        zoo._sync(cuda)
        row["warm_compile_s"] = round(time.perf_counter() - t, 3)
        torch._dynamo.reset()
        for side in ("tctune", "inductor"):  # zoo.py's order: tctune first
            row["current"] = f"compile {side}"
            save()
            if side == "tctune":
                tb.reset()
                make, call_args = (lambda: torch.compile(built.model, backend=backend, options=options)), inputs
            else:
                low = copy.deepcopy(built.model).to(dt).eval()
                make, call_args = (lambda: torch.compile(low, mode=args.inductor_mode)), low_inputs
            t = time.perf_counter()
            try:
                fn = make()
                fn(*call_args)
                zoo._sync(cuda)
            except Exception as exc:  # noqa: BLE001 - recorded
                row.update(status="error", reason=f"{side} compile: {zoo.one_line(exc)}")
                save()
                return row
            row["sides"][side] = {"compile_s": round(time.perf_counter() - t, 3)}
            if side == "tctune":
                reps = list(tb.reports)
                stage: dict[str, float] = {}
                per_pass: dict[str, float] = {}
                for r in reps:
                    for k, v in r.seconds.items():
                        stage[k] = round(stage.get(k, 0.0) + v, 3)
                    for k, v in getattr(r, "pass_seconds", {}).items():
                        per_pass[k] = round(per_pass.get(k, 0.0) + v, 4)
                row["tctune_report"] = {"subgraphs": len(reps), "stage_s": stage, "pass_s": per_pass,
                                        "fallbacks": [(r.fallback.strip().splitlines() or [""])[0][:300]
                                                      for r in reps if r.fallback],
                                        "summaries": [r.summary()[:400] for r in reps[:16]]}
            fns[side] = (fn, call_args)
        row["current"] = "profile"
        save()
        prof: dict = {}
        with zoo.gpu_timing_lock(lock, waits):
            for side in SIDES:
                fn, call_args = fns[side]
                for _ in range(args.warmup):
                    fn(*call_args)
                zoo._sync(cuda)
                row["sides"][side]["wall_ms"] = round(zoo._block_ms(fn, call_args, args.iters, cuda), 4)
                prof[side] = profile_kernels(fn, call_args, args.iters, cuda)
        row["gpu_lock_wait_s"] = round(sum(waits), 2)
    for side in SIDES:
        row["sides"][side].update(side_summary(prof[side], args.iters))
    row.update(diff(prof["inductor"], prof["tctune"], args.iters))
    row.update(status="ok", current=None, wall_s=round(time.perf_counter() - _T0, 1))
    save()
    return row


# ------------------------------------------------------------------------------------------------ runner


def read_rows(out: Path, names: list[str] | None = None) -> list[dict]:
    """The ``profile.json`` rows under ``out`` (``names``: those models, in that order, when present)."""
    if names is not None:
        paths = [model_dir(out, n) / "profile.json" for n in names]
    else:
        paths = sorted(Path(out).glob("*/profile.json"))
    return [json.loads(p.read_text()) for p in paths if p.exists()]


def write_combined(out: Path, names: list[str] | None = None) -> Path:
    path = Path(out) / "profile.md"
    path.write_text(combined_markdown(read_rows(out, names)))
    return path


def _child_cmd(name: str, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--out", str(args.out), "--dtype",
           args.dtype, "--scale", repr(args.scale), "--seq", str(args.seq), "--device", args.device, "--iters",
           str(args.iters), "--warmup", str(args.warmup)]
    for path in args.recipe or ():
        cmd += ["--recipe", path]
    if args.batch:
        cmd += ["--batch", str(args.batch)]
    if args.tctune_options:
        cmd += ["--tctune-options", args.tctune_options]
    if args.inductor_mode:
        cmd += ["--inductor-mode", args.inductor_mode]
    return cmd + (["--tiny"] if args.tiny else [])


def run_all(entries: list, args: argparse.Namespace) -> list[dict]:
    """One process per model, ``--jobs`` at a time, under ``--model-timeout`` and ``--budget-s``."""
    queue = list(entries)
    active: list[tuple] = []
    cuda = args.device.startswith("cuda")
    while queue or active:
        while queue and len(active) < max(1, args.jobs):
            left = args.budget_s - (time.perf_counter() - _T0) if args.budget_s else math.inf
            if left < args.min_model_s:
                for e in queue:
                    _save(args.out, {"name": e.name, "suite": e.suite, "status": "skipped",
                                     "reason": f"--budget-s: {left:.0f} s left"})
                print(f"[profile] not started (budget): --models {','.join(e.name for e in queue)}", flush=True)
                queue.clear()
                break
            e = queue.pop(0)
            timeout = min(args.model_timeout, left - 10)
            env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
            if cuda:
                env["ZOO_GPU_LOCK"] = str(Path(args.out).resolve() / ".gpu.lock")
            if args.jobs > 1:
                env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // args.jobs)))
            cache = tempfile.mkdtemp(prefix="zoo_profile_cache_")
            env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            err = tempfile.TemporaryFile()
            proc = subprocess.Popen(_child_cmd(e.name, args), stderr=err, env=env, start_new_session=True)
            print(f"[profile] {e.name}: started (limit {timeout:.0f} s)", flush=True)
            active.append((e, proc, err, cache, time.perf_counter(), timeout))
        for job in list(active):
            e, proc, err, cache, t0, timeout = job
            rc = proc.poll()
            if rc is None and time.perf_counter() - t0 <= timeout:
                continue
            if rc is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # this model's own process group only
                proc.wait()
            err.seek(0)
            tail = [ln for ln in err.read().decode(errors="replace").splitlines() if ln.strip()]
            err.close()
            shutil.rmtree(cache, ignore_errors=True)
            p = model_dir(args.out, e.name) / "profile.json"
            row = json.loads(p.read_text()) if p.exists() else {"name": e.name, "suite": e.suite}
            if rc is None:
                row.update(status="timeout", reason=f"killed after {timeout:.0f} s (running: {row.get('current')})")
            elif rc != 0 or row.get("status") in (None, "running"):
                row.update(status="error", reason=f"exited {rc}: {tail[-1][:300] if tail else 'no stderr'}")
            _save(args.out, row)
            print(f"[profile] {e.name}: {row.get('status')} in {time.perf_counter() - t0:.0f} s", flush=True)
            active.remove(job)
        if active:
            time.sleep(0.2)
    return read_rows(args.out, [e.name for e in entries])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zoo_profile.py", description="Kernel-by-kernel profile of the tctune "
                                "backend against Inductor on zoo models (see the file's docstring).")
    p.add_argument("--models", help="comma-separated zoo model names (see zoo.py --list)")
    p.add_argument("--out", type=Path, help="output folder: NAME/profile.json and .md per model, profile.md")
    p.add_argument("--table", type=Path, metavar="DIR", help="rewrite DIR/profile.md from the rows under DIR")
    zoo.add_model_args(p)
    p.add_argument("--iters", type=int, default=10, help="timed and profiled calls per side (10)")
    p.add_argument("--warmup", type=int, default=3, help="calls per side after the first, before timing (3)")
    p.add_argument("--jobs", type=int, default=1, help="model processes at once (1)")
    p.add_argument("--model-timeout", type=float, default=150.0, help="seconds per model process (150)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for the whole call")
    p.add_argument("--min-model-s", type=float, default=40.0, help="no model starts with less left (40)")
    p.add_argument("--recipe", action="append", metavar="FILE",
                   help="also profile this model file (build_model / example_inputs, as tctune optimize reads it) "
                        "as recipe-<stem>; repeatable")
    p.add_argument("--batch", type=int, default=None, help="batch size for every model (default: the zoo's, scaled)")
    p.add_argument("--tctune-options", metavar="JSON",
                   help='backend options over the default {"precision": --dtype, "policy": "pure", "output_dtype": '
                        '"compute"}, e.g. \'{"precision": "fp8", "fp8_keep": ["*.c_proj"], "fp8_fast_accum": true}\'')
    p.add_argument("--inductor-mode", default=None,
                   help="torch.compile mode of the Inductor side (default: none); the tctune side takes a mode "
                        'in --tctune-options ({"mode": ...})')
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.table:
        print(f"wrote {write_combined(args.table)}")
        return 0
    if args.out is None:
        p.error("--out DIR is required (NAME/profile.json per model and profile.md go there)")
    if args.iters < 1:
        p.error(f"--iters must be >= 1, got {args.iters}")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tctune_options:
        try:
            if not isinstance(json.loads(args.tctune_options), dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            p.error(f"--tctune-options must be a JSON object of backend options ({exc})")
    recipes = [recipe_entry(path) for path in args.recipe or ()]
    _RECIPES.update({e.name: str(Path(path).resolve()) for e, path in zip(recipes, args.recipe or ())})
    if args.worker:
        by_name = {**zoo.all_entries(include_test=True), **{e.name: e for e in recipes}}
        profile_model(by_name[args.worker], args)
        return 0
    if not args.models and not recipes:
        p.error("--models or --recipe is required: comma-separated zoo names, e.g. --models "
                "DistilBertForMaskedLM,swin_t, or --recipe recipes/gpt2.py")
    try:
        entries = (zoo.select(args.models) if args.models else []) + recipes
    except ValueError as exc:
        p.error(str(exc))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    run_all(entries, args)
    path = write_combined(args.out, [e.name for e in entries])
    print(path.read_text().split("\n## ")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
