"""Measure what channel / vocabulary padding buys on this GPU, for benchmarks/should_pad_h200.json.

Usage::

    python benchmarks/bench_padding.py --out FILE.json     # on a CUDA GPU (< 60 s on an H200)
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

Protocol (DESIGN.md, "Measuring a candidate"): 3 warm-up calls, then 5 repeats of ``ITERS`` calls each timed
with CUDA events (``time.perf_counter`` on the CPU), median of the repeats, in ms per call. TF32 is off.
Every padded variant's output is compared with the as-is output (max abs difference, reported).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
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


def _capture(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    return torch.export.export(model, (x,), strict=False).module()


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
    res = pad_linear_dims(gm, PassSpec(precision=prec, alignment=ALIGNMENT, arch=arch))
    v_pad = res.notes.get("padded", {}).get("linear", {}).get("N", [v, v])[1]
    r, _ = _row("lm_head", f"pad_linear_dims (V={v_pad})", prec, f"{m}x{k}->{v}", lambda: gm(x), device,
                s["iters"], ref, {"reason": res.notes.get("should_pad", {}).get("linear", {}).get("N", {}).get("reason")})
    rows.append(r)
    big = nn.Linear(k, v_big, bias=False).to(device, dt).eval()
    r, _ = _row("lm_head", f"built V={v_big}", prec, f"{m}x{k}->{v_big}", lambda: big(x), device, s["iters"])
    rows.append(r)
    return rows


def _conv(cin: int, cout: int, kernel: int, stride: int, device, dt) -> nn.Module:
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2).to(device, dt).eval()
    return conv.to(memory_format=torch.channels_last)


def _padded_conv(conv: nn.Module, x: torch.Tensor, prec: str, arch: str):
    with torch.no_grad():
        gm = _capture(conv, x)
    res = pad_conv_channels(gm, PassSpec(precision=prec, alignment=ALIGNMENT, arch=arch))
    gm = gm.to(memory_format=torch.channels_last)  # a measurement-time choice, not a graph change
    padded = res.notes.get("padded", {}).get("conv2d", {})
    return gm, padded


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
    gm, padded = _padded_conv(conv, x, prec, arch)
    r, _ = _row("conv3x3", f"pad_conv_channels {padded}", prec, shape, lambda: gm(x), device, s["iters"], ref)
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


def bench_conv3x3_chain(prec: str, device, s: dict, arch: str) -> list[dict]:
    n, c, c_big, hw, depth = s["chain"]
    dt = DTYPES[prec]
    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(n, c, hw, hw, generator=g).to(device, dt).to(memory_format=torch.channels_last)
    x_big = torch.randn(n, c_big, hw, hw, generator=g).to(device, dt).to(memory_format=torch.channels_last)
    torch.manual_seed(3)
    chain = _chain(c, depth, device, dt)
    shape = f"{depth}x conv3x3 {n}x{c}x{hw}x{hw} NHWC"
    per_conv = lambda row: {"ms_per_conv": row["ms"] / depth}  # noqa: E731
    r_as_is, ref = _row("conv3x3_chain", f"C={c} as is", prec, shape, lambda: chain(x), device, s["iters"])
    with torch.no_grad():
        gm = _capture(chain, x)
    res = pad_conv_channels(gm, PassSpec(precision=prec, alignment=ALIGNMENT, arch=arch))
    gm = gm.to(memory_format=torch.channels_last)  # a measurement-time choice, not a graph change
    ops = [nd.target for nd in gm.graph.nodes if nd.op == "call_function"]
    padded = sorted({f"{a}->{b}" for dims in res.notes.get("padded", {}).values() for a, b in dims.values()})
    r_pad, _ = _row("conv3x3_chain", f"pad_conv_channels C {', '.join(padded)}", prec, shape, lambda: gm(x), device,
                    s["iters"], ref, {"kept_padded": res.notes.get("kept_padded", 0),
                                      "pads": ops.count(torch.ops.aten.constant_pad_nd.default),
                                      "slices": ops.count(torch.ops.aten.slice.Tensor)})
    torch.manual_seed(3)
    big = _chain(c_big, depth, device, dt)
    r_big, _ = _row("conv3x3_chain", f"built C={c_big}", prec, f"{depth}x conv3x3 {n}x{c_big}x{hw}x{hw} NHWC",
                    lambda: big(x_big), device, s["iters"])
    rows = [r_as_is, r_pad, r_big]
    for r in rows:
        r.update(per_conv(r))
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
    gm, padded = _padded_conv(conv3, x3, prec, arch)
    r, _ = _row("stem7x7", f"Cin=3 pad_conv_channels {padded}", prec, f"{n}x3x{hw}x{hw} NHWC -> {cout}",
                lambda: gm(x3), device, s["iters"], ref)
    rows.append(r)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_padding.json", help="JSON file to write (default %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, to check the script")
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
    rows: list[dict] = []
    for prec in ("fp16", "bf16"):
        for bench in (bench_lm_head, bench_conv3x3, bench_conv3x3_chain, bench_stem):
            try:
                rows.extend(bench(prec, device, shapes, arch))
            except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
                rows.append({"case": bench.__name__, "dtype": prec, "error": f"{type(exc).__name__}: {exc}"})
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "arch": arch,
        "torch": torch.__version__,
        "date": _dt.date.today().isoformat(),
        "protocol": f"{WARMUP} warm-up calls, {REPEATS} repeats of {shapes['iters']} calls, median ms/call; "
        + ("CUDA events" if device.type == "cuda" else "time.perf_counter") + "; TF32 off; cudnn.benchmark on",
        "wall_s": round(time.perf_counter() - t0, 1),
        "results": rows,
    }
    print(f"{'case':<13} {'dtype':<5} {'ms':>9}  variant")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<13} {r['dtype']:<5} {'error':>9}  {r['error']}")
        else:
            extra = ""
            if "ms_per_conv" in r:
                extra = f"  ({r['ms_per_conv']:.3f} ms/conv, {r['ratio_vs_native']:.2f}x native)"
            print(f"{r['case']:<13} {r['dtype']:<5} {r['ms']:9.3f}  {r['variant']}{extra}")
    print(f"wall time {report['wall_s']} s on {report['device']}")
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
