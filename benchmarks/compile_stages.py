"""Where ``torch.compile(model, backend="tctune")`` spends compile time beyond plain Inductor, stage by stage (CPU).

For each model, in fresh processes (one per side and repeat) with empty Inductor / Triton cache folders and
``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` (so both sides do the full work), times the first call of

- ``inductor``: ``torch.compile(model.to(dt))`` (plain Inductor on the cast model), and
- ``tctune``: ``torch.compile(model, backend="tctune", options={"precision": dt, "policy": policy})``,

and splits the backend's seconds into its stages by wrapping the backend's own functions: ``export``
(``torch.export.export`` of the frozen Dynamo graph), ``module`` (``ExportedProgram.module()``, export's checks
stripped), ``freeze`` (``_Frozen``: weights stored as buffers), the passes one by one
(``SubgraphReport.pass_seconds``; ``passes_other``: ``run_pipeline``'s time beyond its passes), ``finish``
(round-trip casts, unused weights, plain codegen), ``own_other`` (the rest of the backend's own work: the one
recompile, sorting the inputs), ``own`` (all of the backend's own work) and ``compile_fx`` (Inductor on the
rewritten graph). ``rest`` is the first call minus the backend (Dynamo's trace, guards, the first run). Both sides
report ``compile_fx`` (wall and CPU seconds, the CPU also without the C++ compiler children), the kernels Inductor
generated and the ops AOT autograd handed it, and with ``--phases`` ``torch._dynamo.utils.compile_times``.

Seconds: wall time (``time.perf_counter``) and, per process, CPU time of the process and its waited children
(the C++ compiler runs; ``compile_threads=1`` keeps the compiles in waited children, so CPU seconds count them
and do not depend on other jobs sharing the cores). Before timing, a tiny unrelated function is compiled in the
same process (the one-off C++ toolchain checks are paid there, not by either side).

``--profile N`` also runs cProfile over the backend's first call with the profiler off inside ``compile_fx``
(so the list shows Dynamo and the backend's own work) and prints the N functions with the most cumulative time.
``--profile-scope aot`` profiles both sides' first call with the profiler off only inside Inductor's code
generation (``fx_codegen_and_compile``), so AOT autograd's tracing and joint-graph passes are in the list; with
``--profile-out F`` each side's stats go to ``F.<model>.<repeat>.<side>`` for ``pstats`` (compare the two sides).

Models: Hugging Face entries of ``benchmarks/zoo.py`` built at ``--tiny`` sizes, plus ``hf_resnet`` (a
``transformers`` ResNet at tiny sizes: 2 stages of 1 bottleneck, widths 16 / 32, 3x64x64 images; zoo.py's vision
models need timm / torchvision). ``--full --device cuda``: any zoo entry at the zoo's full sizes and default batch
size, on the GPU, with Inductor's compile worker pool started first (as zoo.py does) and Triton's compiles in it;
one process at a time, so no other compile or timing shares the GPU or the cores (the zoo's compile seconds are
measured with up to seven model processes per GPU). Each row also has ``inductor_counters``
(``torch._dynamo.utils.counters["inductor"]``: pattern-matcher hits, autotuning and benchmarking counts).

  python benchmarks/compile_stages.py --models BertForMaskedLM,DistillGPT2,T5Small,hf_resnet --repeat 2
  python benchmarks/compile_stages.py --models BertForMaskedLM --paths tctune --profile 40

CPU numbers say where the backend's own work goes; they are not the H200's compile times:

  python benchmarks/compile_stages.py --full --device cuda --models convnext_tiny,vit_b_16 --phases --json cs.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODELS = "BertForMaskedLM,DistillGPT2,T5Small,hf_resnet"


def _cpu(children: bool = True) -> float:
    """CPU seconds of this process, plus those of its waited children unless ``children`` is False."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    if children:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        total += kids.ru_utime + kids.ru_stime
    return total


def _hf_resnet(batch: int):
    """A tiny ``transformers`` ResNet classifier and its input (``(batch, 3, 64, 64)`` float32)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
    hf = transformers.ResNetForImageClassification(cfg).eval()
    for mod in hf.modules():  # non-trivial BN statistics (a fresh BN is the identity)
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.5, 0.5)
            mod.running_var.uniform_(0.5, 1.5)

    class First(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(pixel_values=x).logits

    g = torch.Generator().manual_seed(1)
    return First(hf).eval(), (torch.randn(batch, 3, 64, 64, generator=g),)


def _build(name: str, batch: int | None, full: bool = False, device: str = "cpu"):
    """The model (eval, on ``device``) and its inputs: ``hf_resnet``, or a zoo entry at ``--tiny`` sizes, or with
    ``full`` at the zoo's full sizes (any suite; ``batch`` None: the entry's default batch size)."""
    if name == "hf_resnet":
        model, inputs = _hf_resnet(batch or 2)
        return model.to(device), tuple(x.to(device) for x in inputs)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from benchload import load_benchmark

    zoo = load_benchmark("zoo")
    import torch

    torch.manual_seed(0)
    if full:
        entry = zoo.all_entries()[name]
        built = zoo.build(entry, tiny=False, device=device)
        return built.model.eval(), built.make_inputs(batch or entry.batch_size, device, 1)
    built = zoo.build_hf(name, tiny=True, device=device)
    return built.model.eval(), built.make_inputs(batch or 2, device, 1)


def _instrument(tb, stages: dict, cpu: dict, prof, own_only: bool = False, off_in_compile_fx: bool = True):
    """Wrap the backend's steps so their wall seconds add up in ``stages`` (process CPU seconds in ``cpu``);
    the profiler (if any) is off inside ``compile_fx``. ``own_only``: Inductor is not called (the rewritten
    graph module is returned as the compiled callable)."""
    import torch

    def timed(name, fn, off=False):
        def wrapper(*args, **kwargs):
            t, c = time.perf_counter(), time.process_time()
            if off and prof is not None:
                prof.disable()
            try:
                return fn(*args, **kwargs)
            finally:
                if off and prof is not None:
                    prof.enable()
                stages[name] = stages.get(name, 0.0) + time.perf_counter() - t
                cpu[name] = cpu.get(name, 0.0) + time.process_time() - c
        return wrapper

    torch.export.export = timed("export", torch.export.export)
    ep_cls = torch.export.ExportedProgram
    ep_cls.module = timed("module", ep_cls.module)
    frozen_init = tb._Frozen.__init__
    tb._Frozen.__init__ = timed("freeze", frozen_init)
    for fn in ("_strip_export_checks", "_mark_entry_casts"):
        setattr(tb, fn, timed("module", getattr(tb, fn)))
    for fn in ("_drop_round_trips", "_drop_unused_weights", "_plain_codegen", "_stable_cache_key"):
        setattr(tb, fn, timed("finish", getattr(tb, fn)))
    tb.run_pipeline = timed("passes", tb.run_pipeline)
    tb._compile_with_passes = timed("backend", tb._compile_with_passes)
    compile_fx = (lambda gm, example_inputs, config_patches: gm) if own_only else tb.inductor_compile
    tb.inductor_compile = timed("compile_fx", compile_fx, off=off_in_compile_fx)


def child(a) -> None:
    sys.path[:0] = [ROOT]
    import torch
    import torch._inductor.config as iconfig

    cuda = a.device.startswith("cuda")
    if not cuda:  # on CUDA Triton kernels compile in Inductor's worker pool, as for any user
        iconfig.compile_threads = 1
    iconfig.fx_graph_cache = False
    iconfig.autotune_local_cache = False
    import torch._inductor.compile_fx as cfx
    import tctune.backend as tb

    if cuda:  # the compile worker pool started and ready, as zoo.py does before its first compile
        tb._warm_compile_pool()
    f = torch.compile(lambda x: (x * 2).sin() + 1)  # one-off toolchain checks, paid by neither side
    f(torch.randn(8, device=a.device))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, inputs = _build(a.model, a.batch, a.full, a.device)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.precision]
    stages: dict[str, float] = {}
    fx_s = [0.0, 0.0, 0.0]  # wall, CPU (with the C++ compiler children), CPU of this process alone
    orig = cfx.compile_fx

    def counted(*args, **kwargs):
        t, c, c_self = time.perf_counter(), _cpu(), _cpu(children=False)
        try:
            return orig(*args, **kwargs)
        finally:
            fx_s[0] += time.perf_counter() - t
            fx_s[1] += _cpu() - c
            fx_s[2] += _cpu(children=False) - c_self

    cfx.compile_fx = counted
    from collections import Counter

    from torch._inductor import metrics

    inner_graphs: list[Counter] = []  # the graphs AOT autograd hands Inductor's code generation
    orig_codegen = cfx.fx_codegen_and_compile

    def codegen(gm, *args, **kwargs):
        inner_graphs.append(Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        if prof is not None and aot_scope:
            prof.disable()
        try:
            return orig_codegen(gm, *args, **kwargs)
        finally:
            if prof is not None and aot_scope:
                prof.enable()

    cfx.fx_codegen_and_compile = codegen
    metrics.reset()
    aot_scope = a.profile_scope == "aot"
    prof = cProfile.Profile() if (a.profile and (a.path == "tctune" or aot_scope)) else None
    if a.path == "inductor":  # the model and its floating inputs in dt, as torch.compile(model.to(dt)) runs
        c = torch.compile(model.to(dt))
        inputs = tuple(x.to(dt) if x.is_floating_point() else x for x in inputs)
    else:
        _instrument(tb, stages, {}, prof, off_in_compile_fx=not aot_scope)
        backend = "tctune" if "tctune" in torch._dynamo.list_backends() else tb.tctune_backend  # not pip-installed
        c = torch.compile(model, backend=backend, options={"precision": a.precision, "policy": a.policy})
    t0, c0, s0 = time.perf_counter(), _cpu(), _cpu(children=False)
    if prof is not None:
        prof.enable()
    with torch.no_grad():
        c(*inputs)
    if cuda:
        torch.cuda.synchronize()
    if prof is not None:
        prof.disable()
    row = {"device": a.device, "batch": int(inputs[0].shape[0]) if inputs and inputs[0].dim() else None,
           "inductor_counters": {k: int(v) for k, v in torch._dynamo.utils.counters["inductor"].items()},
           "model": a.model, "path": a.path, "first_call_s": time.perf_counter() - t0, "cpu_s": _cpu() - c0,
           "self_cpu_s": _cpu(children=False) - s0,
           "compile_fx_s": fx_s[0], "compile_fx_cpu_s": fx_s[1], "compile_fx_self_cpu_s": fx_s[2], "kernels": metrics.generated_kernel_count,
           "aot_ops": sum(sum(c.values()) for c in inner_graphs),
           "aot_op_counts": dict(sum(inner_graphs, Counter()))}
    if a.path == "tctune":
        passes: dict[str, float] = {}
        for r in tb.reports:
            for k, v in r.pass_seconds.items():
                passes[k] = passes.get(k, 0.0) + v
        row["stages"] = dict(stages)  # "passes": run_pipeline's wall time, its passes and its one recompile
        row["passes"] = passes
        row["passes_other"] = max(0.0, stages.get("passes", 0.0) - sum(passes.values()))
        row["own_s"] = stages.get("backend", 0.0) - stages.get("compile_fx", 0.0)
        row["reports"] = [r.summary() for r in tb.reports]
        row["fallbacks"] = sum(bool(r.fallback) for r in tb.reports)
    if a.phases:
        from torch._dynamo.utils import compile_times

        try:
            names, secs = compile_times(repr="csv", aggregate=True)
            row["phases"] = {n: float(s) for n, s in zip(names, secs)}
        except Exception as exc:  # noqa: BLE001 - the phase table is extra
            row["phases"] = {"unavailable": str(exc)}
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(a.profile)
        row["profile"] = buf.getvalue()
        if a.profile_out:
            prof.dump_stats(a.profile_out)
    print("RESULT " + json.dumps(row))


def profile_diff(inductor_stats: str, tctune_stats: str, top: int = 40) -> str:
    """The ``top`` functions whose cumulative seconds grow most from the Inductor side's profile to tctune's
    (two ``cProfile`` stats files of one model): ``+seconds, inductor seconds/calls, tctune seconds/calls``."""
    def load(path):
        return {f"{f.split('site-packages/')[-1]}:{line}:{name}": (ct, nc)
                for (f, line, name), (_cc, nc, _tt, ct, _callers) in pstats.Stats(path).stats.items()}

    a, b = load(inductor_stats), load(tctune_stats)
    # Ties (a callee that grows exactly as much as its caller) are broken by name, so the order is the same run
    # to run.
    keys = sorted(set(a) | set(b), key=lambda k: (-(b.get(k, (0.0, 0))[0] - a.get(k, (0.0, 0))[0]), k))
    lines = [f"{'+s':>7} {'inductor s/calls':>17} {'tctune s/calls':>17}  function"]
    for k in keys[:top]:
        (sa, na), (sb, nb) = a.get(k, (0.0, 0)), b.get(k, (0.0, 0))
        lines.append(f"{sb - sa:7.2f} {sa:9.2f}/{na:<7} {sb:9.2f}/{nb:<7}  {k[-120:]}")
    return "\n".join(lines)


def own_steps(a) -> None:
    """``--own-only K``: the backend's own steps without Inductor, K+1 compiles per model in this process (the
    first one discarded), each after ``torch._dynamo.reset()``; prints the median process CPU seconds of each
    stage (CPU time: the machine's other jobs change wall time more than CPU time)."""
    sys.path[:0] = [ROOT]
    import torch
    import tctune.backend as tb

    stages: dict[str, float] = {}
    cpu: dict[str, float] = {}
    _instrument(tb, stages, cpu, None, own_only=True)
    rows = {}
    for name in a.models.split(","):
        model, inputs = _build(name, a.batch, a.full, a.device)
        runs = []
        for k in range(a.own_only + 1):
            torch._dynamo.reset()
            tb.reset()
            cpu.clear()
            c = torch.compile(model, backend="tctune", options={"precision": a.precision, "policy": a.policy})
            c0 = time.process_time()
            with torch.no_grad():
                c(*inputs)
            total = time.process_time() - c0
            passes = {}
            for r in tb.reports:
                for p_name, v in r.pass_seconds.items():
                    passes[p_name] = passes.get(p_name, 0.0) + v
            if k:
                own = cpu.get("backend", 0.0) - cpu.get("compile_fx", 0.0)
                runs.append(dict(cpu, own=own, first_call=total, passes_wall=sum(passes.values()),
                                 fired=[f"{r.name} {r.count}" for rep in tb.reports for r in rep.results if r.count]))
        keys = [k for k in runs[0] if k != "fired"]
        rows[name] = {k: _median([r.get(k, 0.0) for r in runs]) for k in keys}
        rows[name]["fired"] = runs[-1]["fired"]
        print(f"{name:24} " + "  ".join(f"{k} {rows[name][k]:.3f}" for k in keys), flush=True)
        print(f"{'':24} fired: {', '.join(rows[name]['fired'])}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": {k: v for k, v in vars(a).items() if k not in ("path", "model")}, "own": rows}, fh,
                      indent=2)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated (default %(default)s)")
    p.add_argument("--batch", type=int, default=None,
                   help="batch size (default 2; with --full the zoo entry's default batch size)")
    p.add_argument("--full", action="store_true",
                   help="build zoo entries (any suite) at zoo.py's full sizes instead of --tiny Hugging Face configs")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the models run and compile")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per side process (default %(default)s)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--policy", default="pure", choices=["pure", "autocast"])
    p.add_argument("--paths", default="inductor,tctune")
    p.add_argument("--repeat", type=int, default=1, help="processes per side and model (default %(default)s)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile the backend; top N functions")
    p.add_argument("--profile-scope", default="backend", choices=["backend", "aot"],
                   help="backend (default): the backend's first call, compile_fx excluded; aot: both sides' first "
                        "call, only Inductor's code generation excluded")
    p.add_argument("--profile-out", default=None, metavar="F",
                   help="write each profiled side's cProfile stats to F.<model>.<repeat>.<side>")
    p.add_argument("--phases", action="store_true", help="record torch._dynamo.utils.compile_times per side")
    p.add_argument("--own-only", type=int, default=0, metavar="K",
                   help="time only the backend's own steps (no Inductor), K compiles per model in one process, "
                        "median process CPU seconds per stage")
    p.add_argument("--json", default=None, metavar="FILE", help="write every row here")
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.path:
        return child(a)
    if a.own_only:
        return own_steps(a)
    rows = []
    for model in a.models.split(","):
        for rep in range(a.repeat):
            for path in a.paths.split(","):
                d = tempfile.mkdtemp(prefix="compile_stages_")
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=d, TRITON_CACHE_DIR=os.path.join(d, "triton"),
                           TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
                if not a.device.startswith("cuda"):
                    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
                argv = [sys.executable, os.path.abspath(__file__), "--model", model, "--path", path,
                        "--precision", a.precision, "--policy", a.policy, "--device", a.device,
                        "--profile", str(a.profile), "--profile-scope", a.profile_scope] \
                    + (["--phases"] if a.phases else []) \
                    + (["--full"] if a.full else []) + (["--batch", str(a.batch)] if a.batch else [])
                if a.profile_out:
                    argv += ["--profile-out", f"{a.profile_out}.{model.replace('/', '_')}.{rep}.{path}"]
                try:
                    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.timeout)
                except subprocess.TimeoutExpired:
                    print(f"{model} {path}: over --timeout {a.timeout:g} s", flush=True)
                    continue
                line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
                if not line:
                    print(f"{model} {path} failed:\n{out.stderr[-3000:]}", flush=True)
                    continue
                row = json.loads(line[0][7:])
                row["repeat"] = rep
                rows.append(row)
                if a.json:  # after every row: a call stopped by its time limit keeps what finished
                    _write_rows(a, rows)
                print(f"{model:24} {path:8} first call {row['first_call_s']:6.2f} s  cpu {row['cpu_s']:6.2f} s  "
                      f"compile_fx {row['compile_fx_s']:6.2f} s  cpu {row.get('compile_fx_cpu_s', 0.0):6.2f} s "
                      f"(in-process {row.get('compile_fx_self_cpu_s', 0.0):5.2f} s)",
                      flush=True)
    print()
    stage_names = ["export", "module", "freeze", "passes", "passes_other", "finish", "own_other", "own",
                   "compile_fx", "rest"]
    print(f"{'model':24} {'ind s':>6} {'tct s':>6} {'ratio':>5} {'ind cpu':>7} {'tct cpu':>7} {'ratio':>5} | "
          + " ".join(f"{n[:9]:>9}" for n in stage_names))
    for model in a.models.split(","):
        ind = [r for r in rows if r["model"] == model and r["path"] == "inductor"]
        tct = [r for r in rows if r["model"] == model and r["path"] == "tctune"]
        iw, tw = _median([r["first_call_s"] for r in ind]), _median([r["first_call_s"] for r in tct])
        ic, tc = _median([r["cpu_s"] for r in ind]), _median([r["cpu_s"] for r in tct])
        st = {}
        for n in stage_names:
            vals = []
            for r in tct:
                s = r["stages"]
                if n == "passes":
                    v = sum(r["passes"].values())
                elif n == "passes_other":
                    v = r["passes_other"]
                elif n == "own":
                    v = s.get("backend", 0.0) - s.get("compile_fx", 0.0)
                elif n == "own_other":  # in the backend, in no stage above (the one recompile, classifying)
                    v = (s.get("backend", 0.0) - s.get("compile_fx", 0.0)
                         - sum(s.get(k, 0.0) for k in ("export", "module", "freeze", "passes", "finish")))
                elif n == "rest":  # Dynamo's trace, guards, the first run
                    v = r["first_call_s"] - s.get("backend", 0.0)
                else:
                    v = s.get(n, 0.0)
                vals.append(v)
            st[n] = _median(vals)

        def f(x, w=6):
            return f"{x:{w}.2f}" if x is not None else " " * (w - 1) + "-"

        ratio = f(tw / iw, 5) if iw and tw else "    -"
        cratio = f(tc / ic, 5) if ic and tc else "    -"
        print(f"{model:24} {f(iw)} {f(tw)} {ratio} {f(ic, 7)} {f(tc, 7)} {cratio} | "
              + " ".join(f(st[n], 9) for n in stage_names))
    passes = sorted({k for r in rows if r["path"] == "tctune" for k in r["passes"]})
    if passes:
        print("\npass seconds (median over repeats)")
        for model in a.models.split(","):
            tct = [r for r in rows if r["model"] == model and r["path"] == "tctune"]
            print(f"  {model:24} " + ", ".join(
                f"{k} {_median([r['passes'].get(k, 0.0) for r in tct]):.3f}" for k in passes))
    for r in rows:
        if r.get("profile"):
            scope = ("first call, Inductor's code generation excluded" if a.profile_scope == "aot"
                     else "backend's first call, compile_fx excluded")
            print(f"\n== cProfile of the {scope}: {r['model']} ({r['path']})\n{r['profile']}")
    if a.profile and a.profile_scope == "aot" and a.profile_out:
        for model in a.models.split(","):
            for rep in range(a.repeat):
                stem = f"{a.profile_out}.{model.replace('/', '_')}.{rep}"
                if os.path.exists(f"{stem}.inductor") and os.path.exists(f"{stem}.tctune"):
                    print(f"\n== where tctune's first call spends more than Inductor's: {model}\n"
                          f"{profile_diff(f'{stem}.inductor', f'{stem}.tctune', a.profile)}")
    if a.json:
        _write_rows(a, rows)


def _write_rows(a, rows: list[dict]) -> None:
    with open(a.json, "w") as fh:
        json.dump({"args": {k: v for k, v in vars(a).items() if k not in ("path", "model")}, "rows": rows},
                  fh, indent=2)


if __name__ == "__main__":
    main()
