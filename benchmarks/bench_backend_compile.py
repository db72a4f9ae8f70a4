"""Compile-time probe for issue #7: plain torch.compile (Inductor) against backend="tctune", phase by phase.

Each (path, repeat) runs in a fresh subprocess with its own empty TORCHINDUCTOR_CACHE_DIR (and Triton cache)
and TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 unless --caches.  Before timing, a tiny unrelated function is compiled
with Inductor in the same process (pays the one-off C++ ISA check / CUDA init / Triton import), then
torch._dynamo.reset().  Timed: the first call of the compiled model (Dynamo + backend + codegen + kernels),
and separately the time inside Inductor's compile_fx (patched wrapper), FX nodes handed to compile_fx, and
Inductor's generated kernel count.

  python benchmarks/bench_backend_compile.py --device cuda --model gpt2 --batch 32 --seq 512 --precision fp16
  python benchmarks/bench_backend_compile.py --device cpu --model gpt2 --layers 2 --seq 64
  ... --caches warm [--unfix]   # second process on a filled cache; --unfix re-creates the pre-fix state
  ... --profile 25              # also cProfile each compile: the 25 functions with the most cumulative time
Columns "aot h/m/b" / "fx h/m/b": AOTAutogradCache and FX graph cache hit/miss/bypass counts. With
``--json FILE`` every row (with ``torch._dynamo.utils.compile_times`` per phase) is written there too.
"""
import argparse, cProfile, io, json, os, pstats, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(a):
    sys.path[:0] = [ROOT, os.path.join(ROOT, "recipes")]
    import torch
    import torch._inductor.compile_fx as cfx
    from torch._inductor import metrics
    import tctune.backend as tb

    dev = torch.device(a.device)
    if a.unfix:  # re-create the pre-fix state: ep.module()'s train/eval bound to the module itself
        import types
        strip = tb._strip_export_checks

        def unfixed(gm):
            strip(gm)
            gm.train = types.MethodType(lambda self, mode=True: self, gm)
            gm.eval = types.MethodType(lambda self: self, gm)
        tb._strip_export_checks = unfixed
        tb._stable_cache_key = lambda gm: None  # keep the hash-seed-ordered _non_persistent_buffers_set
    # warm-up: one-off costs both paths pay (ISA check, CUDA context, Triton import)
    f = torch.compile(lambda x: (x * 2).sin() + 1)
    f(torch.randn(8, device=dev)); torch._dynamo.reset()

    if a.model == "gpt2":
        import gpt2 as r
        over = {"n_layer": a.layers} if a.layers else {}
        m = r.make_model(**over); vocab = 50257
    else:
        import bert_base as r
        m = r.build_model(); vocab = 30522
        if a.layers:
            from transformers import BertConfig, BertModel
            torch.manual_seed(0)
            m = r.BertEncoder(BertModel(BertConfig(num_hidden_layers=a.layers), add_pooling_layer=False))
    x = torch.randint(0, vocab, (a.batch, a.seq), device=dev)
    m = m.eval().to(dev)
    if a.path == "inductor" and a.precision in ("fp16", "bf16"):
        m = m.to(getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[a.precision]))
    stats = {"compile_fx_s": 0.0, "fx_nodes": 0, "get_attr": 0, "placeholders": 0, "calls": 0}
    orig = cfx.compile_fx

    def timed(gm, inputs, *args, **kw):
        stats["calls"] += 1
        nodes = list(gm.graph.nodes)
        stats["fx_nodes"] += len(nodes)
        stats["get_attr"] += sum(n.op == "get_attr" for n in nodes)
        stats["placeholders"] += sum(n.op == "placeholder" for n in nodes)
        t = time.perf_counter()
        try:
            return orig(gm, inputs, *args, **kw)
        finally:
            stats["compile_fx_s"] += time.perf_counter() - t

    cfx.compile_fx = timed
    metrics.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    if a.path == "inductor":
        c = torch.compile(m)
    else:
        prec = a.precision or ("fp32" if dev.type == "cpu" else None)
        c = torch.compile(m, backend=tb.backend(precision=prec, target=a.target))
    prof = cProfile.Profile() if a.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    with torch.no_grad():
        c(x)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    if prof:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(a.profile)
        stats["profile"] = buf.getvalue()[-12000:]
    from torch._dynamo.utils import compile_times
    try:
        stats["phases"] = compile_times(repr="csv", aggregate=True)
    except Exception as exc:  # noqa: BLE001 - the phase table is extra
        stats["phases"] = f"unavailable: {exc}"
    t0 = time.perf_counter()
    with torch.no_grad():
        c(x)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    from torch._dynamo.utils import counters
    aot, ind = counters["aot_autograd"], counters["inductor"]
    stats["aot_cache"] = "/".join(str(aot[k]) for k in ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"))
    stats["fx_cache"] = "/".join(str(ind[k]) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"))
    stats.update(first_call_s=first, second_call_s=time.perf_counter() - t0,
                 kernels=metrics.generated_kernel_count,
                 report=[r.summary() for r in tb.reports])
    print("RESULT " + json.dumps(stats))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default %(default)s)")
    p.add_argument("--model", default="gpt2", choices=["gpt2", "bert"], help="recipe family (default %(default)s)")
    p.add_argument("--layers", type=int, default=0, help="0: the recipe's full depth")
    p.add_argument("--batch", type=int, default=1, help="batch size of the compiled call (default %(default)s)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default %(default)s)")
    p.add_argument("--precision", default=None, help="tctune precision; plain path casts the model to it")
    p.add_argument("--target", default=None, help="tctune target (e.g. h200 to plan GPU passes on CPU)")
    p.add_argument("--repeat", type=int, default=1, help="processes per path (default %(default)s)")
    p.add_argument("--paths", default="inductor,tctune",
                   help="inductor (plain torch.compile of the model cast to --precision) and/or tctune (the backend)")
    p.add_argument("--caches", default="off", choices=["off", "cold", "warm"],
                   help="off: TORCHINDUCTOR_FORCE_DISABLE_CACHES=1; cold: caches on, empty dir; warm: caches on, "
                        "dir filled by an unreported run of the same path first")
    p.add_argument("--unfix", action="store_true", help="re-create the pre-fix state (bound train/eval, non-persistent buffer set) for A/B")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile the compile; print the top N functions")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every row as JSON here")
    p.add_argument("--path", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.path:
        return child(a)
    rows = []
    for rep in range(a.repeat):
        for path in a.paths.split(","):
            env = dict(os.environ)
            d = tempfile.mkdtemp(prefix="probe_cache_")
            env["TORCHINDUCTOR_CACHE_DIR"] = d
            env["TRITON_CACHE_DIR"] = os.path.join(d, "triton")
            if a.caches == "off":
                env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
            argv = [sys.executable, __file__, "--path", path] + [
                s for k, v in vars(a).items()
                if k not in ("path", "repeat", "paths", "caches", "unfix", "json") and v is not None
                for s in (f"--{k}", str(v))] + (["--unfix"] if a.unfix else [])
            if a.caches == "warm":
                subprocess.run(argv, env=env, capture_output=True, text=True)
            t = time.perf_counter()
            out = subprocess.run(argv, env=env, capture_output=True, text=True)
            line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            if not line:
                print(out.stderr[-3000:]); raise SystemExit(f"{path} failed")
            r = json.loads(line[0][7:]); r["path"] = path; r["proc_s"] = time.perf_counter() - t
            rows.append(r)
    print(f"\n{a.model} layers={a.layers or 'full'} batch={a.batch} seq={a.seq} device={a.device} "
          f"precision={a.precision} target={a.target} caches={a.caches}{' UNFIXED' if a.unfix else ''}")
    print(f"{'path':9} {'first call s':>12} {'compile_fx s':>12} {'2nd call s':>10} {'fx nodes':>8} "
          f"{'get_attr':>8} {'inputs':>6} {'kernels':>7} {'aot h/m/b':>9} {'fx h/m/b':>8}")
    for r in rows:
        print(f"{r['path']:9} {r['first_call_s']:12.2f} {r['compile_fx_s']:12.2f} {r['second_call_s']:10.4f} "
              f"{r['fx_nodes']:8d} {r['get_attr']:8d} {r['placeholders']:6d} {r['kernels']:7d} "
              f"{r['aot_cache']:>9} {r['fx_cache']:>8}")
        for s in r["report"]:
            print("    tctune:", s)
    phase = {}
    for r in rows:  # compile_times(repr="csv", aggregate=True): [names, seconds]
        if isinstance(r.get("phases"), (list, tuple)) and len(r["phases"]) == 2:
            phase[r["path"]] = {n: float(v) for n, v in zip(*r["phases"])}
    if len(phase) == 2:
        names = sorted(set().union(*phase.values()), key=lambda n: -max(p.get(n, 0.0) for p in phase.values()))
        paths = list(phase)
        print(f"\n{'phase (torch._dynamo.utils.compile_times)':<60} " + " ".join(f"{p:>10}" for p in paths))
        for n in names[:30]:
            print(f"{n[:60]:<60} " + " ".join(f"{phase[p].get(n, 0.0):10.2f}" for p in paths))
    for r in rows:
        if r.get("profile"):
            print(f"\n== cProfile of the {r['path']} compile (cumulative)\n{r['profile']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k != "path"}, "rows": rows}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
