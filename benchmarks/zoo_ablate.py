"""Pass ablation on zoo models: which of tctune's passes make the backend slower than Inductor, and where on the GPU.

Usage::

    python benchmarks/zoo_ablate.py --models MT5ForConditionalGeneration,swin_t --jobs-per-gpu 4 \\
        --out $OUT/ablate --budget-s 400                                   # one GPU call
    python benchmarks/zoo_ablate.py --models DistilBertForMaskedLM --tiny --device cpu --out /tmp/a  # CPU dry run
    python benchmarks/zoo_ablate.py --table DIR                            # the table of the rows under DIR

Sizing a call: a model costs 2 + 1 + (leave-one-out variants) compiles of about 10-40 s each on an H200 host
(more when several processes compile at once), so run as many processes as models on one GPU
(``--jobs-per-gpu``, all in one wave), ``--max-variants 3``, and ``--model-timeout`` a little under
``--budget-s``: a variant that would not finish before its process's deadline is skipped, not killed half-way.

Models are built by ``benchmarks/zoo.py`` (imported, module ``tctune_bench_zoo``): same configs, random weights,
batch sizes (``--scale``), seeded inputs, timing helpers and per-GPU timing lock. Each model runs in its own
process (``--model-timeout`` seconds, killed with its process group after that; fresh Inductor / Triton cache
folders) and writes ``OUT/NAME.json`` after every step, so a killed model keeps what it finished.

Variants, all in ``torch.no_grad`` on the same inputs, compiled in this order:

=====================  ==================================================================================
``inductor``           ``torch.compile(copy.deepcopy(model).to(dt))``: the baseline, inputs cast to dt
``full``               ``torch.compile(model, backend="tctune", options={"precision": dt, "policy": "pure",
                       "output_dtype": "compute"})`` (the backend's default pipeline,
                       ``tctune.backend.BACKEND_PIPELINE``; outputs left in dt like the baseline's,
                       :func:`backend_options`)
``cast_only``          the same with ``passes=("cast_precision",)``: tctune's export and cast, no other pass
``minus_<pass>``       ``passes`` = ``BACKEND_PIPELINE`` without ``<pass>``, one per pass that *fired* in ``full``
                       (``SubgraphReport.count(pass) > 0`` in any subgraph), most rewrites first, at most
                       ``--max-variants``; the cast passes (``passes.CASTS``) are never left out (the variant
                       would not run at dt)
=====================  ==================================================================================

Timing: each tctune variant is timed in a pair with ``inductor`` by ``zoo.time_interleaved`` (repeats
interleaved, alternating order, CUDA events) under the GPU's timing lock, right after its compile, and its
``ratio`` = its items/s / Inductor's items/s *of that pair* (> 1: faster than Inductor). The variant is then
dropped (its memory freed) before the next compiles. A variant is not started when less time is left before the
process deadline than 1.3 x the longest compile so far + 10 s (``skipped`` with the reason).

Profile (Inductor against ``full``, under the lock): ``torch.profiler`` over ``--profile-iters`` calls after
one warm-up call. On CUDA: device kernels (``key_averages``, CUDA device type), per call: the top 15 kernels of
each side by total time with call counts, the kernel time per call, the totals by category (``gemm``:
cuBLAS / CUTLASS / nvjet / sm90 GEMMs; ``attention``: flash / fmha / efficient attention; ``conv``: cuDNN and
convolution kernels; ``triton``: Inductor's generated kernels; ``copy``: memcpy / memset / ``elementwise`` copy;
``other``) and ``diff``: the 15 kernel names with the largest (tctune - Inductor) time per call (what tctune
adds or spends more on), and the 5 with the largest savings. On the CPU: the same over CPU operators (a dry run).

Output: ``OUT/NAME.json`` per model::

    {"name", "suite", "batch_size", "dtype", "output_dtype", "status", "fired": {pass: rewrites}, "subgraphs",
     "fallbacks",
     "variants": {name: {"passes", "ok", "error", "compile_s", "ms", "items_per_s", "ratio",
                         "inductor_items_per_s", "rel_err_vs_inductor", ...}},
     "profile": {"kind", "iters", "inductor": {...}, "full": {...}, "categories", "diff", "saves"},
     "best_removal": {"pass", "ratio", "gain_vs_full"}}

and a markdown table printed last (model, Inductor items/s, full / cast-only / each leave-one-out ratio, the pass
whose removal helps most). ``best_removal``: the ``minus_<pass>`` variant with the highest ratio, when that
ratio beats ``full``'s; ``gain_vs_full`` = its ratio / full's.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchload import load_benchmark

_T0 = time.perf_counter()
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

zoo = load_benchmark("zoo")  # the same module object the tests use

#: Kernels kept per side in the profile, and in the diff.
TOP = 15
#: Kernel-name substrings -> category (first match wins; lower-case).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "attn", "cudnn_sdpa")),
    ("gemm", ("gemm", "cutlass", "cublas", "nvjet", "sm90_xmma", "xmma_gemm", "_mm_", "matmul")),
    ("conv", ("conv", "cudnn", "implicit", "winograd", "fprop")),
    ("triton", ("triton",)),
    ("copy", ("memcpy", "memset", "copy", "cat_", "elementwise")),
)


def category(name: str) -> str:
    """The category of a kernel name (:data:`CATEGORIES`; ``other`` when none matches)."""
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def fired_passes(reports: list) -> dict[str, int]:
    """pass name -> rewrites summed over ``reports`` (``tctune.backend.SubgraphReport``), only passes with > 0."""
    out: dict[str, int] = {}
    for rep in reports:
        for r in rep.results:
            if r.count:
                out[r.name] = out.get(r.name, 0) + int(r.count)
    return out


def variant_plan(fired: dict[str, int], max_variants: int | None = None) -> dict[str, tuple[str, ...]]:
    """The tctune variants after ``full``: ``cast_only`` then ``minus_<pass>`` per fired non-cast pass (most
    rewrites first, ties by pipeline order), at most ``max_variants`` leave-one-out variants (None: all).

    Returns:
        variant name -> the ``passes`` option.
    """
    from passes import CASTS
    from tctune.backend import BACKEND_PIPELINE as PIPELINE  # what ``full`` runs

    plan: dict[str, tuple[str, ...]] = {"cast_only": ("cast_precision",)}
    order = [p for p in PIPELINE if p in fired and p not in CASTS]
    order.sort(key=lambda p: -fired[p])
    if max_variants is not None:
        order = order[:max(0, max_variants)]
    for p in order:
        plan[f"minus_{p}"] = tuple(n for n in PIPELINE if n != p)
    return plan


# ------------------------------------------------------------------------------------------------ profile


def profile_calls(fn, args: tuple, iters: int, cuda: bool) -> dict[str, tuple[float, float]]:
    """Kernel name -> (calls per call of ``fn``, microseconds per call of ``fn``) over ``iters`` profiled calls
    after one warm-up call: CUDA device kernels on CUDA, CPU operators otherwise."""
    fn(*args)
    return {k: (c / iters, t / iters) for k, (c, t) in zoo.profile_by_name(fn, args, iters, cuda).items()}


def _side(kernels: dict[str, tuple[float, float]]) -> dict:
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:TOP]
    return {"us_per_call": round(sum(t for _, t in kernels.values()), 1), "kernels": len(kernels),
            "launches_per_call": round(sum(c for c, _ in kernels.values()), 1),
            "top": [[k[:120], round(c, 2), round(t, 1)] for k, (c, t) in top]}


def compare_profiles(ind: dict[str, tuple[float, float]], tct: dict[str, tuple[float, float]]) -> dict:
    """Compact comparison of two :func:`profile_calls` results (Inductor, tctune): each side's top
    :data:`TOP` ``[name, calls, us]`` per call and totals, per-category us per call, and ``diff`` / ``saves``:
    ``[name, tctune us - Inductor us, tctune calls, Inductor calls]`` with the largest increases / decreases."""
    cats: dict[str, dict[str, float]] = {}
    for side, ks in (("inductor", ind), ("full", tct)):
        for k, (_, t) in ks.items():
            d = cats.setdefault(category(k), {"inductor": 0.0, "full": 0.0})
            d[side] += t
    deltas = []
    for k in set(ind) | set(tct):
        ci, ti = ind.get(k, (0.0, 0.0))
        ct, tt = tct.get(k, (0.0, 0.0))
        deltas.append([k[:120], round(tt - ti, 1), round(ct, 2), round(ci, 2)])
    deltas.sort(key=lambda d: (-d[1], d[0]))
    saves = sorted((d for d in deltas if d[1] < 0), key=lambda d: (d[1], d[0]))[:5]
    return {"inductor": _side(ind), "full": _side(tct),
            "categories": {c: {s: round(v, 1) for s, v in d.items()} | {"delta": round(d["full"] - d["inductor"], 1)}
                           for c, d in sorted(cats.items(), key=lambda kv: -(kv[1]["full"] - kv[1]["inductor"]))},
            "diff": [d for d in deltas[:TOP] if d[1] > 0],
            "saves": saves}


# ------------------------------------------------------------------------------------------------ one model


def backend_options(dtype: str, passes: tuple[str, ...] | None = None) -> dict:
    """The tctune backend's ``options`` for every variant: ``precision`` ``dtype``, policy ``pure`` and
    ``output_dtype`` ``zoo.TCTUNE_OUTPUT_DTYPE`` (``"compute"``: outputs left in ``dtype``, the contract of the
    ``inductor`` baseline ``torch.compile(model.to(dt))``, as in ``benchmarks/zoo.py``; recorded as each row's
    ``output_dtype``), plus ``passes`` when given (None: the backend's default pipeline)."""
    opts: dict = {"precision": dtype, "policy": "pure", "output_dtype": zoo.TCTUNE_OUTPUT_DTYPE}
    if passes is not None:
        opts["passes"] = passes
    return opts


def out_path(out: Path, name: str) -> Path:
    return Path(out) / (name.replace("/", "__") + ".json")


def best_removal(row: dict) -> dict | None:
    """The leave-one-out variant with the highest ratio when it beats ``full``'s (None otherwise)."""
    vs = row.get("variants", {})
    full = vs.get("full", {}).get("ratio")
    loo = [(n[len("minus_"):], v["ratio"]) for n, v in vs.items() if n.startswith("minus_") and v.get("ratio")]
    if not loo or full is None:
        return None
    p, r = max(loo, key=lambda x: x[1])
    return {"pass": p, "ratio": r, "gain_vs_full": round(r / full, 4)} if r > full else None


def measure(entry, args: argparse.Namespace) -> dict:
    """Build ``entry`` and measure its variants (module docstring); rewrites ``OUT/NAME.json`` after each step."""
    import torch

    import tctune.backend as tb

    cuda = args.device.startswith("cuda")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    batch = zoo.scaled_batch(entry.batch_size, args.scale)
    deadline = _T0 + (args.deadline_s or math.inf)
    path = out_path(args.out, entry.name)
    lock = os.environ.get("ZOO_GPU_LOCK") or None
    waits: list[float] = []
    row: dict = {"name": entry.name, "suite": entry.suite, "batch_size": batch, "dtype": args.dtype,
                 "output_dtype": zoo.TCTUNE_OUTPUT_DTYPE, "device": args.device, "tiny": bool(args.tiny), "status": "running", "current": "build",
                 "variants": {}, "started": _dt.datetime.now().isoformat(timespec="seconds"),
                 "procs_per_gpu": int(os.environ.get("ZOO_PROCS_PER_GPU", "1"))}
    save = lambda: zoo._write_json(path, row)  # noqa: E731
    save()
    # Every variant recompiles the same forward code objects with another backend.
    for key in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), 256))
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        torch.manual_seed(0)
        built = zoo.build(entry, args.tiny, args.seq, args.device)
    except Exception as exc:  # noqa: BLE001 - recorded
        row.update(status="not_built", reason=zoo.one_line(exc))
        save()
        return row
    model = built.model
    inputs = built.make_inputs(batch, args.device, 1234)
    low_inputs = tuple(x.to(dt) if x.is_floating_point() else x for x in inputs)
    row.update(params=built.params, inputs=built.desc)
    compile_s: list[float] = []

    def compile_variant(name: str, make, call_args: tuple) -> tuple[Any, Any] | None:
        v = row["variants"].setdefault(name, {})
        left = deadline - time.perf_counter()
        need = 1.3 * max(compile_s, default=0.0) + 10.0
        if left < need:
            v.update(ok=False, skipped=f"time: {left:.0f} s left before the deadline, need ~{need:.0f} s")
            save()
            return None
        row["current"] = name
        save()
        t = time.perf_counter()
        try:
            fn = make()
            out = fn(*call_args)
            zoo._sync(cuda)
        except Exception as exc:  # noqa: BLE001 - recorded per variant
            v.update(ok=False, error=zoo.one_line(exc))
            if cuda:
                torch.cuda.empty_cache()
            save()
            return None
        compile_s.append(time.perf_counter() - t)
        v.update(ok=True, compile_s=round(compile_s[-1], 2))
        return fn, out

    def timed_pair(name: str, fn, ind) -> None:
        row["current"] = f"timing {name}"
        save()
        try:
            with zoo.gpu_timing_lock(lock, waits):
                res = zoo.time_interleaved({"inductor": (ind, low_inputs), name: (fn, inputs)}, cuda,
                                           args.repeats, args.repeat_s)
        except Exception as exc:  # noqa: BLE001
            row["variants"][name].update(ok=False, error=f"timing: {zoo.one_line(exc)}")
            return
        r, ri = res[name], res["inductor"]
        row["variants"][name].update(ms=round(r["ms"], 4), items_per_s=round(batch / (r["ms"] / 1e3), 2),
                                     inductor_ms=round(ri["ms"], 4),
                                     inductor_items_per_s=round(batch / (ri["ms"] / 1e3), 2),
                                     ratio=round(ri["ms"] / r["ms"], 4), iters=r["iters"])
        row["gpu_lock_wait_s"] = round(sum(waits), 2)
        save()

    # The registered name when tctune is installed, else the callable (torch.compile passes options to both).
    backend = "tctune" if "tctune" in torch._dynamo.list_backends() else tb.tctune_backend

    def tctune_options(passes: tuple[str, ...] | None) -> dict:
        return backend_options(args.dtype, passes)

    with torch.no_grad():
        low = copy.deepcopy(model).to(dt).eval()
        got = compile_variant("inductor", lambda: torch.compile(low), low_inputs)
        if got is None:
            row.update(status="error", reason=f"inductor: {row['variants']['inductor']}")
            save()
            return row
        ind, ind_out = got
        row["variants"]["inductor"]["passes"] = None
        tb.reset()
        n0 = len(tb.reports)
        got = compile_variant("full", lambda: torch.compile(model, backend=backend, options=tctune_options(None)),
                              inputs)
        reports = list(tb.reports[n0:])
        fired = fired_passes(reports)
        row.update(fired=fired, subgraphs=len(reports),
                   fallbacks=[(r.fallback.strip().splitlines() or [""])[0][:300] for r in reports if r.fallback],
                   summaries=[r.summary()[:300] for r in reports[:16]])
        row["variants"]["full"]["passes"] = list(tb.BACKEND_PIPELINE)
        if got is not None:
            full, out = got
            row["variants"]["full"]["rel_err_vs_inductor"] = zoo.rel_err(out.float(), ind_out.float())["rel_err"]
            del out
            timed_pair("full", full, ind)
            row["current"] = "profile"
            save()
            try:
                with zoo.gpu_timing_lock(lock, waits):
                    pi = profile_calls(ind, low_inputs, args.profile_iters, cuda)
                    pf = profile_calls(full, inputs, args.profile_iters, cuda)
                row["profile"] = {"kind": "cuda_kernels" if cuda else "cpu_ops", "iters": args.profile_iters,
                                  **compare_profiles(pi, pf)}
            except Exception as exc:  # noqa: BLE001 - the ratios still stand
                row["profile"] = {"error": zoo.one_line(exc)}
            del full
        plan = variant_plan(fired, args.max_variants)
        row["plan"] = {n: list(p) for n, p in plan.items()}
        save()
        for name, passes in plan.items():
            got = compile_variant(name, lambda: torch.compile(model, backend=backend,
                                                                options=tctune_options(passes)), inputs)
            row["variants"][name]["passes"] = list(passes)
            if got is None:
                continue
            fn, out = got
            row["variants"][name]["rel_err_vs_inductor"] = zoo.rel_err(out.float(), ind_out.float())["rel_err"]
            del out
            timed_pair(name, fn, ind)
            del fn
            if cuda:
                torch.cuda.empty_cache()
    row.update(status="ok", current=None, best_removal=best_removal(row), wall_s=round(time.perf_counter() - _T0, 1))
    save()
    return row


# ------------------------------------------------------------------------------------------------ table


def _r(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(rows: list[dict]) -> str:
    """Markdown: model, Inductor items/s, full / cast-only ratios, each leave-one-out ratio, best removal."""
    lines = ["| model | status | Inductor items/s | full | cast-only | leave-one-out (ratio without the pass) "
             "| removal that helps most |", "|---|---|---:|---:|---:|---|---|"]
    for row in rows:
        vs = row.get("variants", {})
        ind = vs.get("full", {}).get("inductor_items_per_s")
        loo = ", ".join(f"-{n[len('minus_'):]} {_r(v.get('ratio'))}" + ("" if v.get("ok", True) else
                                                                         " (" + (v.get("skipped") or "error") + ")")
                        for n, v in vs.items() if n.startswith("minus_")) or "-"
        best = row.get("best_removal")
        best_s = f"{best['pass']} ({best['ratio']:.2f}, x{best['gain_vs_full']:.2f} vs full)" if best else "none"
        lines.append(f"| {row.get('name')} | {row.get('status')} | {'-' if ind is None else f'{ind:.0f}'} | "
                     f"{_r(vs.get('full', {}).get('ratio'))} | {_r(vs.get('cast_only', {}).get('ratio'))} | "
                     f"{loo} | {best_s} |")
    return "\n".join(lines)


def read_rows(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))]


# ------------------------------------------------------------------------------------------------ runner


def _child_cmd(name: str, args: argparse.Namespace, timeout: float) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--out", str(args.out), "--dtype",
           args.dtype, "--scale", repr(args.scale), "--seq", str(args.seq), "--device", args.device, "--repeats",
           str(args.repeats), "--repeat-s", repr(args.repeat_s), "--profile-iters", str(args.profile_iters),
           "--deadline-s", repr(max(1.0, timeout - 5))]
    if args.max_variants is not None:
        cmd += ["--max-variants", str(args.max_variants)]
    return cmd + (["--tiny"] if args.tiny else [])


def run_all(entries: list, args: argparse.Namespace) -> list[dict]:
    """One process per model on ``zoo.gpu_slots`` slots, under ``--model-timeout`` and ``--budget-s``."""
    slots = zoo.gpu_slots(args.gpus, args.jobs_per_gpu, args.device.startswith("cuda"))
    queue = list(entries)
    active: dict[int, tuple] = {}
    while queue or active:
        for i in [i for i in range(len(slots)) if i not in active]:
            if not queue:
                break
            left = args.budget_s - (time.perf_counter() - _T0) if args.budget_s else math.inf
            if left < args.min_model_s:
                for e in queue:
                    zoo._write_json(out_path(args.out, e.name), {"name": e.name, "suite": e.suite, "status":
                                    "skipped", "reason": f"--budget-s: {left:.0f} s left", "variants": {}})
                print(f"[ablate] not started (budget): --models {','.join(e.name for e in queue)}", flush=True)
                queue.clear()
                break
            e = queue.pop(0)
            timeout = min(args.model_timeout, left - 10)
            gpu = slots[i]
            env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
            if gpu is not None:
                env.update(CUDA_VISIBLE_DEVICES=gpu, ZOO_GPU_LOCK=str(Path(args.out).resolve() / f".gpu-{gpu}.lock"),
                           ZOO_PROCS_PER_GPU=str(slots.count(gpu)))
                env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // len(slots))))
            cache = tempfile.mkdtemp(prefix="ablate_cache_")
            env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            err = tempfile.TemporaryFile()
            proc = subprocess.Popen(_child_cmd(e.name, args, timeout), stderr=err, env=env, start_new_session=True)
            print(f"[ablate] {e.name}: started (GPU {gpu}, limit {timeout:.0f} s)", flush=True)
            active[i] = (e, proc, err, cache, time.perf_counter(), timeout)
        for i, (e, proc, err, cache, t0, timeout) in list(active.items()):
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
            p = out_path(args.out, e.name)
            row = json.loads(p.read_text()) if p.exists() else {"name": e.name, "suite": e.suite, "variants": {}}
            if rc is None:
                row.update(status="timeout", reason=f"killed after {timeout:.0f} s (running: {row.get('current')})")
            elif rc != 0 or row.get("status") in (None, "running"):
                row.update(status="error", reason=f"exited {rc}: {tail[-1][:300] if tail else 'no stderr'}")
            if row.get("status") != "ok":
                row["best_removal"] = best_removal(row)
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            zoo._write_json(p, row)
            print(f"[ablate] {e.name}: {row.get('status')} in {row['wall_s']:.0f} s", flush=True)
            del active[i]
        if active:
            time.sleep(0.2)
    return [json.loads(out_path(args.out, e.name).read_text()) for e in entries
            if out_path(args.out, e.name).exists()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zoo_ablate.py", description="Leave-one-out pass ablation and kernel profile "
                                "of the tctune backend against Inductor on zoo models (see the file's docstring).")
    p.add_argument("--models", help="comma-separated zoo model names (see zoo.py --list)")
    p.add_argument("--out", type=Path, help="output folder: NAME.json per model")
    p.add_argument("--table", type=Path, metavar="DIR", help="print the table of the rows under DIR and exit")
    zoo.add_model_args(p)
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per pair (5)")
    p.add_argument("--repeat-s", type=float, default=0.05, help="seconds per timed repeat (0.05)")
    p.add_argument("--profile-iters", type=int, default=5, help="profiled calls per side (5)")
    p.add_argument("--max-variants", type=int, default=None, help="at most this many leave-one-out variants")
    p.add_argument("--gpus", help="comma-separated GPU indices, one slot each (repeats allowed)")
    p.add_argument("--jobs-per-gpu", type=int, default=1, help="model processes per GPU (1)")
    p.add_argument("--model-timeout", type=float, default=380.0, help="seconds per model process (380)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for the whole call")
    p.add_argument("--min-model-s", type=float, default=60.0, help="no model starts with less left (60)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--deadline-s", type=float, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.table:
        print(table(read_rows(args.table)))
        return 0
    if args.out is None:
        p.error("--out DIR is required (one NAME.json per model goes there)")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        measure(zoo.all_entries(include_test=True)[args.worker], args)
        return 0
    if not args.models:
        p.error("--models is required: comma-separated zoo names, e.g. --models DistilBertForMaskedLM,swin_t")
    try:
        entries = zoo.select(args.models)
        zoo.gpu_slots(args.gpus, args.jobs_per_gpu, args.device.startswith("cuda"))
    except ValueError as exc:
        p.error(str(exc))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = run_all(entries, args)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
