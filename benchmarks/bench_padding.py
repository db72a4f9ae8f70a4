"""Measure what channel / vocabulary padding buys on this GPU, for benchmarks/should_pad_h200.json.

Usage::

    python benchmarks/bench_padding.py --out FILE.json     # on a CUDA GPU (< 80 s on an H200; --budget)
    python benchmarks/bench_padding.py --dry-run --out FILE.json   # tiny shapes on the CPU, to check the script

Without a CUDA GPU (and without ``--dry-run``) it prints a message and exits 0.

Cases, each at fp16 and bf16, in one run:

* LM head ``x (16384, 768) @ W^T``, ``W (V, 768)``: V=50257 as is; after ``pad_linear_dims`` on the captured
  graph (``torch.export``; the multiple comes from ``passes.should_pad``: 64 where measured as fast, else 8);
  and a linear built with V=50304.
* 3x3 conv, 61 -> 61 channels, batch 256, 56x56, channels-last: as is; after ``pad_conv_channels`` on the
  captured graph; and a 64-channel conv.
* 3x3 conv chain: 4 consecutive 3x3 convs, 61 -> 61 channels, ReLU between, batch 256, 56x56, channels-last:
  as is; after ``pad_conv_channels`` on the captured graph (which keeps the channels padded between the
  convs: one pad at the input, one slice at the output); and a chain built with 64 channels. Rows report
  ``ms`` for the whole chain, ``ms_per_conv`` (ms / 4) and ``ratio_vs_native`` (ms / the 64-channel chain's);
  target: the padded chain within 10 % of the native one.
* 7x7 stride-2 stem conv, Cin 3 -> 64, batch 256, 224x224, channels-last: Cin 3 as is, built with Cin 4 and
  Cin 8, and Cin 3 after ``pad_conv_channels`` (which includes the channel-pad op).

The LM head and the conv chain above must return eager's dense output, so the padded graphs pay a boundary
copy (the (16384, 50257) logits: ~1.7 ms on the H200; the chain's input pad and output slice: ~0.27 ms). In a
real graph the logits feed a consumer and a compiler can fuse such copies into neighbouring ops. Cases for
that (rows report ``ratio_vs_native``, ms / the native variant's ms):

* ``lm_head_argmax``: the same LM head followed by ``logits.argmax(-1)`` (greedy decoding; returns int64
  ids), and ``lm_head_xent``: followed by ``F.cross_entropy(logits.float(), labels)`` (the training /
  scoring loss, upcast to fp32 as Hugging Face's causal-LM loss does; ``labels`` (16384,) a second graph
  input). Variants: V=50257 as is; after ``pad_linear_dims`` on the captured graph (the argmax / loss reads
  the slice ``logits[..., :50257]``, so no dense copy of the logits is made); and built with V=50304 *sliced to
  50257* before the consumer. The slice is what makes the native variant fair: a V=50304 head's 47 extra
  logits are real outputs (random rows here) that an argmax could pick and a softmax would normalise over,
  so without it the native model would compute another function; with it, it does exactly the padded
  graph's work, and the rows differ only in the GEMM's N (50264 or 50304 per ``should_pad``) and in the
  graph rewrite. The V=50304 head's first 50257 rows are the as-is weights, so its output is compared with
  the as-is one too. Target (issue 3): the padded variant within 5 % of the native one (``ratio_vs_native``
  <= 1.05). The head's rows share a common direction ``u`` (as trained heads' rows do) and the last 8 input
  rows (2 in the dry run) are ``-sqrt(K) u``, so every real logit of those rows is negative
  (``probe_max_logit`` < 0) and a padded column's logit 0 would win if the slice were lost: argmax rows
  report ``ids_ge_V`` (ids >= 50257, the pass's contract says 0), ``argmax_mismatches`` (positions where the
  id differs from the as-is one: different GEMM kernels round near-ties differently) and, as every row, the
  max abs difference of the output (for argmax: of the ids) against the as-is output.
* ``inductor_lm_head_argmax``, ``inductor_lm_head_xent``, ``inductor_conv3x3_chain``: the same three models
  (as is, padded graph, native) compiled by ``torch.compile(model)`` (default mode; Dynamo state reset and
  the FX graph and AOTAutograd caches off for each compile, so every graph is compiled cold: Triton / C++
  kernel binaries may still come from the kernel caches). The compile (the first call) is timed apart from
  the timed loop and reported as ``compile_s``; ``max_abs_diff_vs_as_is`` is against the *eager* as-is
  output. Inductor pads matmuls itself (``torch._inductor.config.shape_padding``, benchmark-gated ``pad_mm``,
  CUDA only): its value is in every such row (``inductor_shape_padding``) and in
  the report's ``inductor`` entry, and LM-head rows list which of the vocabulary sizes V, round_up(V, 8),
  round_up(V, 64) occur in Inductor's generated code (``inductor_code_V``: 50264 in the as-is variant means
  Inductor padded N itself). Conv-chain rows record ``channels_last_out`` (whether Inductor's output is
  channels-last, as the eager chain's is). Same targets as the eager cases.

Protocol (``tctune.measure``'s): 3 warm-up calls, then 5 repeats of ``ITERS`` calls each timed
with CUDA events (``time.perf_counter`` on the CPU), median of the repeats, in ms per call. TF32 is off.
Every padded variant's output is compared with the as-is output (max abs difference, reported).

Time (full shapes, H200; the protocol above unchanged for every case): the first four cases took 16 s; the
argmax / cross-entropy cases add ~10 s (export, and the as-is head's ~15 ms calls); the 18 Inductor compiles
(3 variants x 3 models x 2 dtypes, a few seconds each; their timed loops ~2 s in all) the rest.
``benchmarks/run_h200.sh`` stops this step at 90 s, so the Inductor cases run last, fp16 before bf16, and on
the GPU a compiled variant that would not end within ``--budget`` seconds of the start (default 75; none in
the dry run) is skipped with the reason in its row (``"skipped"`` instead of ``"ms"``). The JSON file is
rewritten after every case, so a stopped run keeps what it measured.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from passes import PassSpec  # noqa: E402
from passes.pad_conv import pad_conv_channels  # noqa: E402
from passes.pad_linear import pad_linear_dims  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ALIGNMENT = {"fp16": 8, "bf16": 8, "tf32": 4}
WARMUP, REPEATS = 3, 5
#: Full shapes (GPU) and tiny shapes (``--dry-run`` on the CPU).
SHAPES = {
    "full": {"lm": (16384, 768, 50257, 50304), "conv3": (256, 61, 64, 56), "chain": (256, 61, 64, 56, 4),
             "stem": (256, 64, 224), "iters": 10},
    "tiny": {"lm": (4, 16, 50257, 50304), "conv3": (2, 61, 64, 8), "chain": (2, 61, 64, 8, 4), "stem": (2, 8, 16),
             "iters": 2},
}


def arch_name(device: torch.device) -> str:
    """Architecture name for the should-pad table (``"Hopper"`` for sm_90); the CPU dry run uses Hopper's rules."""
    if device.type != "cuda":
        return "Hopper"
    major, minor = torch.cuda.get_device_capability(device)
    return {7: "Turing" if minor >= 5 else "Volta", 8: "Ada" if minor >= 9 else "Ampere", 9: "Hopper"}.get(
        major, "Blackwell" if major >= 10 else "unknown"
    )


def time_ms(fn: Callable[[], torch.Tensor], device: torch.device, iters: int) -> list[float]:
    """ms per call of ``fn`` for each of ``REPEATS`` repeats of ``iters`` calls, after ``WARMUP`` calls."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / iters)
    return times


def _capture(model: nn.Module, x: torch.Tensor, *more: torch.Tensor) -> torch.fx.GraphModule:
    return torch.export.export(model, (x, *more), strict=False).module()


def _row(case: str, variant: str, prec: str, shape: str, fn, device, iters, ref=None, extra=None) -> dict:
    with torch.inference_mode():
        out = fn()
        times = time_ms(fn, device, iters)
    row = {"case": case, "variant": variant, "dtype": prec, "shape": shape, "ms": statistics.median(times),
           "ms_repeats": times}
    if ref is not None:
        row["max_abs_diff_vs_as_is"] = (out.float() - ref.float()).abs().max().item()
    if extra:
        row.update(extra)
    return row, out


def bench_lm_head(prec: str, device, s: dict, arch: str) -> list[dict]:
    m, k, v, v_big = s["lm"]
    dt = DTYPES[prec]
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device, dt)
    head = nn.Linear(k, v, bias=False).to(device, dt).eval()
    rows = []
    r, ref = _row("lm_head", f"V={v} as is", prec, f"{m}x{k}->{v}", lambda: head(x), device, s["iters"])
    rows.append(r)
    with torch.no_grad():
        gm = _capture(head, x)
    v_pad, reason = _padded_lm_head(gm, v, prec, arch)
    r, _ = _row("lm_head", f"pad_linear_dims (V={v_pad})", prec, f"{m}x{k}->{v}", lambda: gm(x), device,
                s["iters"], ref, {"reason": reason})
    rows.append(r)
    big = nn.Linear(k, v_big, bias=False).to(device, dt).eval()
    r, _ = _row("lm_head", f"built V={v_big}", prec, f"{m}x{k}->{v_big}", lambda: big(x), device, s["iters"])
    rows.append(r)
    return rows


def _padded_lm_head(gm: torch.fx.GraphModule, v: int, prec: str, arch: str) -> tuple[int, str | None]:
    """``pad_linear_dims`` on a captured graph with one LM-head linear (in place): its padded V and the reason."""
    res = pad_linear_dims(gm, PassSpec(precision=prec, alignment=ALIGNMENT, arch=arch))
    v_pad = next(iter(res.notes.get("padded", {}).values()), {}).get("N", [v, v])[1]
    reason = next(iter(res.notes.get("should_pad", {}).values()), {}).get("N", {}).get("reason")
    return v_pad, reason


def _conv(cin: int, cout: int, kernel: int, stride: int, device, dt) -> nn.Module:
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2).to(device, dt).eval()
    return conv.to(memory_format=torch.channels_last)


def _padded_conv(model: nn.Module, x: torch.Tensor, prec: str, arch: str):
    """The captured ``model`` after ``pad_conv_channels``, channels-last, and the pass result."""
    with torch.no_grad():
        gm = _capture(model, x)
    res = pad_conv_channels(gm, PassSpec(precision=prec, alignment=ALIGNMENT, arch=arch))
    gm = gm.to(memory_format=torch.channels_last)  # a measurement-time choice, not a graph change
    return gm, res


def bench_conv3x3(prec: str, device, s: dict, arch: str) -> list[dict]:
    n, c, c_big, hw = s["conv3"]
    dt = DTYPES[prec]
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(n, c, hw, hw, generator=g).to(device, dt).to(memory_format=torch.channels_last)
    x_big = torch.randn(n, c_big, hw, hw, generator=g).to(device, dt).to(memory_format=torch.channels_last)
    conv = _conv(c, c, 3, 1, device, dt)
    shape = f"{n}x{c}x{hw}x{hw} NHWC"
    rows = []
    r, ref = _row("conv3x3", f"C={c} as is", prec, shape, lambda: conv(x), device, s["iters"])
    rows.append(r)
    gm, res = _padded_conv(conv, x, prec, arch)
    r, _ = _row("conv3x3", f"pad_conv_channels {res.notes.get('padded', {}).get('conv2d', {})}", prec, shape, lambda: gm(x), device, s["iters"], ref)
    rows.append(r)
    big = _conv(c_big, c_big, 3, 1, device, dt)
    r, _ = _row("conv3x3", f"built C={c_big}", prec, f"{n}x{c_big}x{hw}x{hw} NHWC", lambda: big(x_big), device,
                s["iters"])
    rows.append(r)
    return rows


class ConvChain(nn.Module):
    """``depth`` 3x3 convs of ``c`` channels (stride 1, padding 1) with a ReLU between consecutive ones."""

    def __init__(self, c: int, depth: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(x)
            if i < len(self.convs) - 1:
                x = torch.relu(x)
        return x


def _chain(c: int, depth: int, device, dt) -> nn.Module:
    return ConvChain(c, depth).to(device, dt).eval().to(memory_format=torch.channels_last)


#: Models built once per (case, dtype) and shared by the eager and the Inductor benches.
_BUILT: dict[tuple[str, str], dict] = {}


def _chain_variants(prec: str, device, s: dict, arch: str) -> dict:
    """The 4-conv chain's inputs and its three variants (as is, padded graph, native), built once per dtype."""
    key = ("chain", prec)
    if key in _BUILT:
        return _BUILT[key]
    n, c, c_big, hw, depth = s["chain"]
    dt = DTYPES[prec]
    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(n, c, hw, hw, generator=g).to(device, dt).to(memory_format=torch.channels_last)
    x_big = torch.randn(n, c_big, hw, hw, generator=g).to(device, dt).to(memory_format=torch.channels_last)
    torch.manual_seed(3)
    chain = _chain(c, depth, device, dt)
    gm, res = _padded_conv(chain, x, prec, arch)
    ops = [nd.target for nd in gm.graph.nodes if nd.op == "call_function"]
    padded = sorted({f"{a}->{b}" for dims in res.notes.get("padded", {}).values() for a, b in dims.values()})
    torch.manual_seed(3)
    big = _chain(c_big, depth, device, dt)
    _BUILT[key] = {
        "x": x, "x_big": x_big, "chain": chain, "gm": gm, "big": big, "padded": ", ".join(padded),
        "pad_extra": {"kept_padded": res.notes.get("kept_padded", 0),
                      "pads": ops.count(torch.ops.aten.constant_pad_nd.default),
                      "slices": ops.count(torch.ops.aten.slice.Tensor)},
        "shape": f"{depth}x conv3x3 {n}x{c}x{hw}x{hw} NHWC",
        "shape_big": f"{depth}x conv3x3 {n}x{c_big}x{hw}x{hw} NHWC",
        "c": c, "c_big": c_big, "depth": depth,
    }
    return _BUILT[key]


def bench_conv3x3_chain(prec: str, device, s: dict, arch: str) -> list[dict]:
    b = _chain_variants(prec, device, s, arch)
    x, x_big, chain, gm, big, depth = b["x"], b["x_big"], b["chain"], b["gm"], b["big"], b["depth"]
    r_as_is, ref = _row("conv3x3_chain", f"C={b['c']} as is", prec, b["shape"], lambda: chain(x), device, s["iters"])
    b["ref"] = ref
    r_pad, _ = _row("conv3x3_chain", f"pad_conv_channels C {b['padded']}", prec, b["shape"], lambda: gm(x), device,
                    s["iters"], ref, b["pad_extra"])
    r_big, _ = _row("conv3x3_chain", f"built C={b['c_big']}", prec, b["shape_big"], lambda: big(x_big), device,
                    s["iters"])
    rows = [r_as_is, r_pad, r_big]
    for r in rows:
        r["ms_per_conv"] = r["ms"] / depth
        r["ratio_vs_native"] = r["ms"] / r_big["ms"]
    return rows


def bench_stem(prec: str, device, s: dict, arch: str) -> list[dict]:
    n, cout, hw = s["stem"]
    dt = DTYPES[prec]
    g = torch.Generator(device="cpu").manual_seed(2)
    rows = []
    ref = None
    for cin in (3, 4, 8):
        x = torch.randn(n, cin, hw, hw, generator=g).to(device, dt).to(memory_format=torch.channels_last)
        conv = _conv(cin, cout, 7, 2, device, dt)
        r, out = _row("stem7x7", f"Cin={cin}" + (" as is" if cin == 3 else " built"), prec,
                      f"{n}x{cin}x{hw}x{hw} NHWC -> {cout}", lambda: conv(x), device, s["iters"])
        rows.append(r)
        if cin == 3:
            ref, x3, conv3 = out, x, conv
    gm, res = _padded_conv(conv3, x3, prec, arch)
    r, _ = _row("stem7x7", f"Cin=3 pad_conv_channels {res.notes.get('padded', {}).get('conv2d', {})}", prec, f"{n}x3x{hw}x{hw} NHWC -> {cout}",
                lambda: gm(x3), device, s["iters"], ref)
    rows.append(r)
    return rows


class LMHeadConsumer(nn.Module):
    """``logits = x @ W^T`` (``W: (V, K)``, no bias), ``logits[..., :keep]`` when ``V > keep``, then the consumer:
    ``"argmax"`` -> ``logits.argmax(-1)``; ``"xent"`` -> ``F.cross_entropy(logits.float(), labels)``."""

    def __init__(self, k: int, v: int, keep: int, consumer: str) -> None:
        super().__init__()
        self.head = nn.Linear(k, v, bias=False)
        self.keep, self.consumer = keep, consumer

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(x)
        if logits.shape[-1] > self.keep:
            logits = logits[..., : self.keep]
        if self.consumer == "argmax":
            return logits.argmax(-1)
        return F.cross_entropy(logits.float(), labels)


def _lm_weight(rows: int, k: int, u: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """nn.Linear's init (uniform +-1/sqrt(K)) plus a common component ``b u`` on every row, with ``b`` 8 times the
    std of a row's projection on the unit vector ``u``: every row has ``w . u > 0``."""
    bound = k**-0.5
    w = (torch.rand(rows, k, generator=g) * 2 - 1) * bound
    return w + 8 * bound / 3**0.5 * u


def _lm_variants(consumer: str, prec: str, device, s: dict, arch: str) -> dict:
    """The LM head + ``consumer`` inputs and its three variants (as is, padded graph, native), built once per dtype."""
    key = (consumer, prec)
    if key in _BUILT:
        return _BUILT[key]
    m, k, v, v_big = s["lm"]
    dt = DTYPES[prec]
    g = torch.Generator(device="cpu").manual_seed(4)
    u = torch.randn(k, generator=g)
    u = u / u.norm()
    probes = min(8, m // 2)
    x = torch.randn(m, k, generator=g)
    x[m - probes:] = -(k**0.5) * u  # every real logit < 0 (see _lm_weight): a padded column's 0 would win
    x = x.to(device, dt)
    args = (x,) if consumer == "argmax" else (x, torch.randint(0, v, (m,), generator=g).to(device))
    w = _lm_weight(v_big, k, u, g)
    as_is = LMHeadConsumer(k, v, v, consumer)
    native = LMHeadConsumer(k, v_big, v, consumer)
    with torch.no_grad():
        as_is.head.weight.copy_(w[:v])
        native.head.weight.copy_(w)  # the same first V rows: its output is comparable with the as-is one
    as_is, native = as_is.to(device, dt).eval(), native.to(device, dt).eval()
    with torch.no_grad():
        gm = _capture(as_is, *args)
        probe_max = (x[m - probes:] @ as_is.head.weight.T).max().item()
    v_pad, reason = _padded_lm_head(gm, v, prec, arch)
    _BUILT[key] = {"args": args, "as_is": as_is, "gm": gm, "native": native, "v": v, "v_pad": v_pad, "v_big": v_big,
                   "reason": reason, "probes": probes, "probe_max_logit": probe_max,
                   "shape": f"{m}x{k}->{v} + {consumer}", "shape_big": f"{m}x{k}->{v_big}[:{v}] + {consumer}"}
    return _BUILT[key]


def _lm_checks(b: dict, out: torch.Tensor, ref: torch.Tensor | None, consumer: str) -> dict:
    """Argmax contract facts: ids >= V (must be 0) and positions whose id differs from the as-is one."""
    if consumer != "argmax":
        return {}
    facts = {"ids_ge_V": int((out >= b["v"]).sum().item()), "probe_rows": b["probes"],
             "probe_max_logit": b["probe_max_logit"]}
    if ref is not None:
        facts["argmax_mismatches"] = int((out != ref).sum().item())
    return facts


def _bench_lm_consumer(consumer: str, prec: str, device, s: dict, arch: str) -> list[dict]:
    b = _lm_variants(consumer, prec, device, s, arch)
    args, as_is, gm, native = b["args"], b["as_is"], b["gm"], b["native"]
    case = f"lm_head_{consumer}"
    r_as_is, ref = _row(case, f"V={b['v']} as is", prec, b["shape"], lambda: as_is(*args), device, s["iters"])
    r_as_is.update(_lm_checks(b, ref, None, consumer))
    b["ref"] = ref
    r_pad, out = _row(case, f"pad_linear_dims (V={b['v_pad']})", prec, b["shape"], lambda: gm(*args), device,
                      s["iters"], ref, {"reason": b["reason"]})
    r_pad.update(_lm_checks(b, out, ref, consumer))
    r_nat, out = _row(case, f"built V={b['v_big']}, sliced to {b['v']}", prec, b["shape_big"],
                      lambda: native(*args), device, s["iters"], ref)
    r_nat.update(_lm_checks(b, out, ref, consumer))
    rows = [r_as_is, r_pad, r_nat]
    for r in rows:
        r["ratio_vs_native"] = r["ms"] / r_nat["ms"]
    return rows


def bench_lm_head_argmax(prec: str, device, s: dict, arch: str) -> list[dict]:
    return _bench_lm_consumer("argmax", prec, device, s, arch)


def bench_lm_head_xent(prec: str, device, s: dict, arch: str) -> list[dict]:
    return _bench_lm_consumer("xent", prec, device, s, arch)


# ------------------------------------------------------------------------------------------ Inductor cases


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Budget:
    """Wall-clock budget for the compiled variants (``--budget``): a compile is started only when it is expected
    to end within the budget (expected: the longest compile so far, 20 s before the first)."""

    def __init__(self, t0: float, budget_s: float | None) -> None:
        self.t0, self.budget_s, self.longest = t0, budget_s, None

    def record(self, seconds: float) -> None:
        self.longest = max(self.longest or 0.0, seconds)

    def refuse(self) -> str | None:
        if self.budget_s is None:
            return None
        elapsed, expected = time.perf_counter() - self.t0, 20.0 if self.longest is None else self.longest
        if elapsed + expected <= self.budget_s:
            return None
        return (f"{elapsed:.0f} s of the {self.budget_s:.0f} s budget spent and a compile may take "
                f"{expected:.0f} s (benchmarks/run_h200.sh stops this step at 150 s)")


BUDGET = _Budget(time.perf_counter(), None)


def _compile(module: nn.Module, args: tuple, device) -> tuple[Callable, float, str]:
    """``torch.compile(module)`` (default mode) and its first call, timed: ``(compiled, compile_s, code)``.

    Dynamo is reset first (no recompile of a shared ``forward`` with automatic dynamic shapes) and the FX graph
    and AOTAutograd caches are off (a cold compile each time: the bf16 padded head and the native one are the
    same graph, which would otherwise hit the cache); ``code`` is Inductor's generated output code.
    """
    import torch._functorch.config as functorch_config
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(module)
    with torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        _sync(device)
        t0 = time.perf_counter()
        _, codes = run_and_get_code(compiled, *args)  # resets Dynamo, then compiles on this first call
        _sync(device)
        seconds = time.perf_counter() - t0
    BUDGET.record(seconds)
    return compiled, seconds, "\n".join(codes)


def _inductor_rows(case: str, prec: str, device, s: dict, variants: list, ref: torch.Tensor, native_idx: int,
                   facts: Callable[[torch.Tensor, str], dict]) -> list[dict]:
    """Compile and time ``variants``: ``(variant, shape, module, args, compare_with_ref)`` each."""
    rows: list[dict] = []
    for variant, shape, module, args, compare in variants:
        why = BUDGET.refuse()
        if why is not None:
            rows.append({"case": case, "variant": f"compiled {variant}", "dtype": prec, "shape": shape, "skipped": why})
            continue
        try:
            compiled, seconds, code = _compile(module, args, device)
            extra = {"compile_s": round(seconds, 2), "inductor_shape_padding": torch._inductor.config.shape_padding}
            extra.update(facts(None, code))
            r, out = _row(case, f"compiled {variant}", prec, shape, lambda: compiled(*args), device, s["iters"],
                          ref if compare else None, extra)
            r.update(facts(out, ""))
        except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others
            r = {"case": case, "variant": f"compiled {variant}", "dtype": prec, "shape": shape,
                 "error": f"{type(exc).__name__}: {exc}"}
        rows.append(r)
        compiled = None
    if len(rows) > native_idx and "ms" in rows[native_idx]:
        for r in rows:
            if "ms" in r:
                r["ratio_vs_native"] = r["ms"] / rows[native_idx]["ms"]
    return rows


def _bench_inductor_lm(consumer: str, prec: str, device, s: dict, arch: str) -> list[dict]:
    b = _lm_variants(consumer, prec, device, s, arch)
    args = b["args"]
    ref = b.get("ref")
    if ref is None:
        with torch.inference_mode():
            ref = b["as_is"](*args)
    sizes = sorted({b["v"], -(-b["v"] // 8) * 8, -(-b["v"] // 64) * 64})

    def facts(out, code):
        if out is None:
            return {"inductor_code_V": [n for n in sizes if re.search(rf"\b{n}\b", code)]}
        return {k: v for k, v in _lm_checks(b, out, ref, consumer).items() if k in ("ids_ge_V", "argmax_mismatches")}

    variants = [(f"V={b['v']} as is", b["shape"], b["as_is"], args, True),
                (f"pad_linear_dims (V={b['v_pad']})", b["shape"], b["gm"], args, True),
                (f"built V={b['v_big']}, sliced to {b['v']}", b["shape_big"], b["native"], args, True)]
    return _inductor_rows(f"inductor_lm_head_{consumer}", prec, device, s, variants, ref, 2, facts)


def bench_inductor_lm_head_argmax(prec: str, device, s: dict, arch: str) -> list[dict]:
    return _bench_inductor_lm("argmax", prec, device, s, arch)


def bench_inductor_lm_head_xent(prec: str, device, s: dict, arch: str) -> list[dict]:
    return _bench_inductor_lm("xent", prec, device, s, arch)


def bench_inductor_conv3x3_chain(prec: str, device, s: dict, arch: str) -> list[dict]:
    b = _chain_variants(prec, device, s, arch)
    ref = b.get("ref")
    if ref is None:
        with torch.inference_mode():
            ref = b["chain"](b["x"])

    def facts(out, code):
        if out is None:
            return {}
        return {"channels_last_out": bool(out.is_contiguous(memory_format=torch.channels_last))}

    variants = [(f"C={b['c']} as is", b["shape"], b["chain"], (b["x"],), True),
                (f"pad_conv_channels C {b['padded']}", b["shape"], b["gm"], (b["x"],), True),
                (f"built C={b['c_big']}", b["shape_big"], b["big"], (b["x_big"],), False)]
    rows = _inductor_rows("inductor_conv3x3_chain", prec, device, s, variants, ref, 2, facts)
    for r in rows:
        if "ms" in r:
            r["ms_per_conv"] = r["ms"] / b["depth"]
    return rows


#: Eager cases, run for fp16 then bf16; then the Inductor cases, fp16 then bf16 (they are cut first by --budget).
EAGER_BENCHES = (bench_lm_head, bench_conv3x3, bench_conv3x3_chain, bench_stem, bench_lm_head_argmax,
                 bench_lm_head_xent)
INDUCTOR_BENCHES = (bench_inductor_lm_head_argmax, bench_inductor_conv3x3_chain, bench_inductor_lm_head_xent)


def _report(device, arch: str, shapes: dict, t0: float, rows: list[dict]) -> dict:
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "arch": arch,
        "torch": torch.__version__,
        "date": _dt.date.today().isoformat(),
        "protocol": f"{WARMUP} warm-up calls, {REPEATS} repeats of {shapes['iters']} calls, median ms/call; "
        + ("CUDA events" if device.type == "cuda" else "time.perf_counter") + "; TF32 off; cudnn.benchmark on",
        "inductor": {"mode": "default", "shape_padding": torch._inductor.config.shape_padding,
                     "force_shape_pad": torch._inductor.config.force_shape_pad,
                     "layout_optimization": torch._inductor.config.layout_optimization,
                     "fx_graph_cache": "off for each compile",
                     "autograd_cache": "off for each compile", "budget_s": BUDGET.budget_s},
        "wall_s": round(time.perf_counter() - t0, 1),
        "results": rows,
    }


def _line(r: dict) -> str:
    head = f"{r['case']:<23} {r['dtype']:<5}"
    if "error" in r:
        return f"{head} {'error':>9}  {r.get('variant', '')} {r['error']}".rstrip()
    if "skipped" in r:
        return f"{head} {'skipped':>9}  {r['variant']}: {r['skipped']}"
    notes = []
    if "ms_per_conv" in r:
        notes.append(f"{r['ms_per_conv']:.3f} ms/conv")
    if "ratio_vs_native" in r:
        notes.append(f"{r['ratio_vs_native']:.2f}x native")
    if "compile_s" in r:
        notes.append(f"compile {r['compile_s']:.1f} s")
    if "ids_ge_V" in r:
        notes.append(f"ids>=V {r['ids_ge_V']}")
    if "argmax_mismatches" in r:
        notes.append(f"mismatches {r['argmax_mismatches']}")
    if "channels_last_out" in r:
        notes.append("channels-last out" if r["channels_last_out"] else "NOT channels-last out")
    if r.get("inductor_code_V"):
        notes.append(f"V in code {r['inductor_code_V']}")
    return f"{head} {r['ms']:9.3f}  {r['variant']}" + (f"  ({', '.join(notes)})" if notes else "")


def main(argv: list[str] | None = None) -> int:
    global BUDGET
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_padding.json", help="JSON file to write (default %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, to check the script")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of wall time after which no compile is started (default: 75 on the GPU, "
                        "none in the dry run)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_padding: no CUDA GPU here; nothing measured (use --dry-run to check the script on the CPU)")
        return 0
    device = torch.device("cpu" if args.dry_run else "cuda")
    shapes = SHAPES["tiny" if args.dry_run else "full"]
    arch = arch_name(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    t0 = time.perf_counter()
    BUDGET = _Budget(t0, args.budget if args.budget is not None else (None if args.dry_run else 75.0))
    rows: list[dict] = []
    plan = [(prec, bench) for benches in (EAGER_BENCHES, INDUCTOR_BENCHES) for prec in ("fp16", "bf16")
            for bench in benches]
    for prec, bench in plan:
        try:
            rows.extend(bench(prec, device, shapes, arch))
        except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
            rows.append({"case": bench.__name__, "dtype": prec, "error": f"{type(exc).__name__}: {exc}"})
        # Rewritten after every case: a run stopped by run_h200.sh's time limit keeps what it measured.
        Path(args.out).write_text(json.dumps(_report(device, arch, shapes, t0, rows), indent=2) + "\n")
    report = _report(device, arch, shapes, t0, rows)
    print(f"{'case':<23} {'dtype':<5} {'ms':>9}  variant")
    for r in rows:
        print(_line(r))
    print(f"wall time {report['wall_s']} s on {report['device']}")
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
