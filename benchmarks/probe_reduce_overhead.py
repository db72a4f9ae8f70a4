"""The backend under ``mode="reduce-overhead"`` (Inductor's CUDA-graph trees): do frozen weights marked static pay?

``tctune.backend._weights_static`` tells Inductor that the weights tctune froze into its graph are static inputs,
as Dynamo's own parameters are. Without it, Inductor's CUDA-graph trees treat each weight as an ordinary input:
copied into the graph's own input buffer at every replay (one read and one write of every weight) and held
twice in memory. This probe compiles the dt model three ways, each in a fresh Inductor cache, all with
``mode="reduce-overhead"``, and times them interleaved (``zoo.time_interleaved``: CUDA events, median of repeats,
order alternating):

======================  ==========================================================================================
``inductor``            ``torch.compile(model.to(dt), mode="reduce-overhead")``
``tctune``              ``torch.compile(model, backend=tctune.backend.backend(mode="reduce-overhead", precision=dt,
                        policy="pure", output_dtype="compute"))`` (weights static, the backend's default)
``tctune_nonstatic``    the same with ``_weights_static`` switched off (the backend before the change)
======================  ==========================================================================================

Per variant also the CUDA memory its compile and first calls kept (``torch.cuda.memory_allocated`` after minus
before, MiB; the CUDA-graph pool's blocks count there) and the number of static inputs Inductor was told of.

Output: ``--out``/``reduce_overhead.json`` and one line per model on stdout.

  python benchmarks/probe_reduce_overhead.py --models BertForMaskedLM,resnet50 --out OUT
"""
from __future__ import annotations

import contextlib
import copy
import time

import torch

import tctune.backend as tb
from benchload import load_benchmark

zoo = load_benchmark("zoo")
frozen = load_benchmark("probe_frozen_weights")


@contextlib.contextmanager
def weights_not_static():
    """``tctune.backend._weights_static`` replaced by a no-op while the block runs (the backend before it)."""
    original = tb._weights_static
    tb._weights_static = lambda exported, gm: None
    try:
        yield
    finally:
        tb._weights_static = original


def measure(name: str, dtype: str, repeats: int, scale: float, device: str = "cuda", tiny: bool = False) -> dict:
    built, dt, batch, cuda = frozen.build_entry(name, dtype, scale, device, tiny)
    model = built.model.eval()
    args32 = tuple(built.make_inputs(batch, device, 1234))
    args = tuple(x.to(dt) if x.is_floating_point() else x for x in args32)
    low = copy.deepcopy(model).to(dt)
    mode = "reduce-overhead" if cuda else None
    opts = {"precision": dtype, "policy": "pure", "output_dtype": "compute", **({"mode": mode} if mode else {})}
    makers = {
        "inductor": (lambda: torch.compile(low, mode=mode), args, contextlib.nullcontext),
        "tctune": (lambda: torch.compile(model, backend=tb.backend(**opts)), args32, contextlib.nullcontext),
        "tctune_nonstatic": (lambda: torch.compile(copy.deepcopy(model), backend=tb.backend(**opts)), args32,
                             weights_not_static),
    }
    seen, restore = frozen.static_input_spy()
    fns, compile_s, kept_mib, static, err = {}, {}, {}, {}, {}
    try:
        with torch.no_grad():
            ref = low(*args)
            for key, (make, a, ctx) in makers.items():
                zoo._sync(cuda)
                before = torch.cuda.memory_allocated() if cuda else 0
                with zoo.compile_cache(True), ctx():
                    t = time.perf_counter()
                    fn = make()
                    for _ in range(3):  # CUDA-graph trees record on the second / third call
                        o = fn(*a)
                    zoo._sync(cuda)
                    compile_s[key] = round(time.perf_counter() - t, 2)
                kept_mib[key] = round(((torch.cuda.memory_allocated() if cuda else 0) - before) / 2**20, 1)
                static[key] = list(seen)
                seen.clear()
                err[key] = zoo.rel_err(o, ref).get("rel_err")
                fns[key] = (fn, a)
            timed = zoo.time_interleaved(fns, cuda, repeats)
    finally:
        restore()
    ms = {k: r["ms"] for k, r in timed.items()}
    return {"name": name, "batch_size": batch, "dtype": dtype, "mode": mode, "ms": ms,
            "speedup_vs_inductor": {k: round(ms["inductor"] / v, 4) for k, v in ms.items()},
            "repeats_ms": {k: r["repeats_ms"] for k, r in timed.items()}, "compile_s": compile_s,
            "kept_mib": kept_mib, "static_inputs": static, "rel_err_vs_dt_eager": err, "device": device}


def main(argv: list[str] | None = None) -> int:
    return frozen.probe_main(argv, __doc__, "BertForMaskedLM,resnet50", measure, "reduce_overhead.json",
                             ("ms", "speedup_vs_inductor", "kept_mib", "static_inputs"),
                             "cuda (default) or cpu (a dry run: default mode, no CUDA graphs)", reset=False)


if __name__ == "__main__":
    raise SystemExit(main())
