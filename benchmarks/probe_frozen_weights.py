"""Is it the frozen weights? Splits the backend's last ~2-3 % against Inductor on models where no structural pass fires.

On such models (swin_t, deit_tiny) the only rewrite is the cast, and ``tctune_lowtrace`` (the backend on the dt
model, nothing left to cast) was as far behind ``torch.compile(model.to(dt))`` as the backend on the FP32 model.
What both tctune paths share, and plain Inductor does not: the graph handed to Inductor reads the weights as
``get_attr`` constants of a ``GraphModule`` (frozen), where Dynamo hands them as graph inputs. This probe compiles
the dt model's Dynamo graph six ways, each in its own fresh Inductor cache, and times them interleaved
(``zoo.time_interleaved``: CUDA events, median of repeats, order alternating), without CUDA graphs and with
(``zoo.cuda_graph``):

=============  ==========================================================================================
``inductor``   ``torch.compile(model.to(dt))``
``fx_inputs``  Dynamo's graph handed to ``compile_fx`` by a custom backend, the weights still graph inputs
``fx_frozen``  the same graph with every parameter / buffer input a buffer of a new module, read by ``get_attr``
               (what tctune's re-export hands ``compile_fx``), the runtime inputs passed on each call
``fx_frozen_static``  the same, the module marked as Dynamo's (``meta["dynamo_compile_id"]``), so AOT autograd
               passes its lifted weights to Inductor as static inputs, as Dynamo's parameters are
``tctune``     ``torch.compile(model.to(dt), backend="tctune", options={"precision": dt, "policy": "pure",
               "output_dtype": "compute"})``
``tctune_static``  that, with the graph tctune hands Inductor marked as Dynamo's (its weights static inputs)
=============  ==========================================================================================

The backend now marks its frozen weights static itself (``tctune.backend._weights_static``), so ``tctune`` and
``tctune_static`` compile the same graph (``NOTES.md`` has the run that measured them apart).

Output: ``--out``/``frozen_weights.json`` (per model: ms per variant, ratios to ``inductor``, the static inputs
Inductor was told of per variant, compile seconds) and one line per model on stdout.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
import torch.fx as fx

from benchload import load_benchmark

zoo = load_benchmark("zoo")


def frozen(static: bool):
    """A backend: ``compile_fx`` of a new ``GraphModule`` holding Dynamo's weight inputs (lifted parameters and
    buffers) as buffers read by ``get_attr`` nodes, the runtime inputs still placeholders, as tctune's
    re-exported graph. ``static``: the module carries Dynamo's ``dynamo_compile_id`` meta, so AOT autograd counts
    its lifted parameters and buffers as static inputs (it does so only for a graph it knows came from Dynamo);
    without it (tctune today) Inductor treats them as ordinary inputs."""

    def backend(gm: fx.GraphModule, example_inputs: list):
        from torch._inductor.compile_fx import compile_fx

        import tctune.backend as tb

        root = torch.nn.Module()
        graph = fx.Graph()
        env: dict = {}
        keep: list[int] = []
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
            if isinstance(value, torch.Tensor) and tb._is_weight(node, value):
                root.register_buffer(f"w{i}", value.detach())
                env[node] = graph.get_attr(f"w{i}")
            else:
                keep.append(i)
                env[node] = graph.placeholder(node.name)
            env[node].meta.update(node.meta)
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                env[node] = graph.node_copy(node, lambda n: env[n])
        new = fx.GraphModule(root, graph)
        if static:
            new.meta["dynamo_compile_id"] = gm.meta.get("dynamo_compile_id")
        compiled = compile_fx(new, [example_inputs[i] for i in keep])

        def call(*args):
            return compiled(*[args[i] for i in keep])

        return call

    return backend


def static_weights(backend):
    """``backend`` (tctune's) with the graph it hands Inductor marked as Dynamo's (``meta["dynamo_compile_id"]``),
    so its frozen weights reach Inductor as static inputs (``fx_frozen_static``'s change, on tctune's graph)."""
    import tctune.backend as tb

    def wrapped(gm: fx.GraphModule, example_inputs: list, **kw):
        original = tb.inductor_compile

        def marked(g, inputs, patches):
            g.meta.setdefault("dynamo_compile_id", gm.meta.get("dynamo_compile_id"))
            return original(g, inputs, patches)

        tb.inductor_compile = marked
        try:
            return backend(gm, example_inputs, **kw)
        finally:
            tb.inductor_compile = original

    return wrapped


def inputs_backend(gm: fx.GraphModule, example_inputs: list):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def static_input_spy():
    """Count, per Inductor compile, the inputs Inductor is told are static (``compile_fx.get_static_input_idxs``):
    ``(list the counts are appended to, function restoring Inductor's own)``."""
    import torch._inductor.compile_fx as cfx

    seen: list[int] = []
    original = cfx.get_static_input_idxs

    def spy(num_fixed: int) -> list[int]:
        idxs = original(num_fixed)
        seen.append(len(idxs))
        return idxs

    def restore() -> None:
        cfx.get_static_input_idxs = original

    cfx.get_static_input_idxs = spy
    return seen, restore


def build_entry(name: str, dtype: str, scale: float, device: str, tiny: bool):
    """The zoo entry ``name`` built seeded on ``device``: ``(zoo.Built, dt as a torch dtype, batch size scaled by
    ``scale``, whether the device is CUDA)``."""
    entry = zoo.all_entries()[name]
    torch.manual_seed(0)
    built = zoo.build(entry, tiny, 512, device)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return built, dt, zoo.scaled_batch(entry.batch_size, scale), device.startswith("cuda")


def measure(name: str, dtype: str, repeats: int, scale: float, device: str = "cuda", tiny: bool = False) -> dict:
    import tctune.backend as tb

    built, dt, batch, cuda = build_entry(name, dtype, scale, device, tiny)
    low = built.model.to(dt).eval()
    args = tuple(x.to(dt) if x.is_floating_point() else x for x in built.make_inputs(batch, device, 1234))
    makers = {
        "inductor": lambda m: torch.compile(m),
        "fx_inputs": lambda m: torch.compile(m, backend=inputs_backend),
        "fx_frozen": lambda m: torch.compile(m, backend=frozen(False)),
        "fx_frozen_static": lambda m: torch.compile(m, backend=frozen(True)),
        "tctune": lambda m: torch.compile(m, backend=tb.backend(precision=dtype, policy="pure",
                                                                output_dtype="compute")),
        "tctune_static": lambda m: torch.compile(m, backend=static_weights(tb.backend(
            precision=dtype, policy="pure", output_dtype="compute"))),
    }
    fns, compile_s, out, static = {}, {}, {}, {}
    seen, restore = static_input_spy()
    with torch.no_grad():
        ref = low(*args)
        for key, make in makers.items():
            with zoo.compile_cache(True):
                t = time.perf_counter()
                fn = make(copy.deepcopy(low))
                o = fn(*args)
                zoo._sync(cuda)
                compile_s[key] = round(time.perf_counter() - t, 2)
            static[key] = list(seen)
            seen.clear()
            out[key] = zoo.rel_err(o, ref).get("rel_err")
            fns[key] = (fn, args)
        plain = zoo.time_interleaved(fns, cuda, repeats)
        restore()
        cg = {}
        if cuda:
            graphs = {f"{k}_cg": (zoo.cuda_graph(fn, a), a) for k, (fn, a) in fns.items()}
            cg = zoo.time_interleaved(graphs, True, repeats)
    ms = {k: r["ms"] for k, r in {**plain, **cg}.items()}
    ratio = {k: round(ms["inductor"] / v, 4) for k, v in ms.items() if not k.endswith("_cg")}
    ratio.update({k: round(ms["inductor_cg"] / v, 4) for k, v in ms.items() if k.endswith("_cg")})
    return {"name": name, "batch_size": batch, "dtype": dtype, "ms": ms, "speedup_vs_inductor": ratio,
            "repeats_ms": {k: r["repeats_ms"] for k, r in {**plain, **cg}.items()}, "compile_s": compile_s,
            "static_inputs": static,
            "rel_err_vs_dt_eager": out, "device": device, "tctune": [r.summary()[:300] for r in tb.reports[:4]]}


def probe_main(argv: list[str] | None, doc: str, default_models: str, measure, out_name: str,
               shown: tuple[str, ...], cpu_help: str, reset: bool = True) -> int:
    """The command line of a probe script: ``measure(name, dtype, repeats, scale, device, tiny)`` per model of
    ``--models`` (after a Dynamo reset when ``reset``), every row so far written to ``--out``/``out_name`` after
    each model, and one line per model on stdout with the row's ``shown`` fields."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--models", default=default_models)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--device", default="cuda", help=cpu_help)
    p.add_argument("--tiny", action="store_true", help="tiny Hugging Face configs (zoo.py --tiny)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for name in a.models.split(","):
        if reset:
            torch._dynamo.reset()
        rows.append(measure(name, a.dtype, a.repeats, a.scale, a.device, a.tiny))
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / out_name).write_text(json.dumps(rows, indent=1))
        print(name, *(json.dumps(rows[-1][k]) for k in shown), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return probe_main(argv, __doc__, "swin_t,deit_tiny_patch16_224.fb_in1k", measure, "frozen_weights.json",
                      ("speedup_vs_inductor", "compile_s", "static_inputs"),
                      "cuda (default) or cpu (a dry run, no CUDA graphs)")


if __name__ == "__main__":
    raise SystemExit(main())
