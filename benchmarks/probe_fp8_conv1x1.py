"""Would FP8 1x1 convolutions (as ``torch._scaled_mm`` GEMMs on channels-last activations) speed up ResNet-50?

A probe before building a pass: for ResNet-50's 1x1 convolution shapes at one batch size, the time of

- ``bf16``: ``relu(x)`` then ``conv2d`` (cuDNN, channels-last) -- what tctune's bf16/fp16 graph runs today;
- ``fp8_row``: ``relu(x)``, per-pixel (row-wise) dynamic FP8 E4M3 quantization of the activation (amax over the
  channels, scale = amax / 448), ``torch._scaled_mm`` with a per-output-channel weight scale, bf16 output viewed
  back as channels-last NCHW -- what ``passes.cast_fp8`` does for linears;
- ``fp8_static``: the same with one fixed per-tensor activation scale (calibration data would give it), so the
  quantization is a single pointwise kernel Inductor can fuse with the ReLU.

Each variant is one ``torch.compile`` (mode default) function, captured as a CUDA graph (``zoo.cuda_graph``) and
timed interleaved with the others (``zoo.time_interleaved``: CUDA events, median of repeats). The ReLU stands for
the elementwise epilogue that precedes every 1x1 convolution in ResNet-50; where the block input also feeds the
residual branch (``conv1`` of a bottleneck), the bf16 activation is returned too, since it must be written
anyway. Relative error of each output against the FP32 convolution of the same input is recorded.

Output: ``--out``/``fp8_conv1x1.json`` (per shape: ms per variant, error; the count of such convolutions in
ResNet-50 and the summed time per variant) and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchload import load_benchmark

zoo = load_benchmark("zoo")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

#: (name, C_in, C_out, H = W of the input, count in torchvision's ResNet-50, input also feeds the residual)
SHAPES = (
    ("l1.conv1", 256, 64, 56, 2, True), ("l1.conv3", 64, 256, 56, 3, False),
    ("l2.conv1", 512, 128, 28, 3, True), ("l2.conv3", 128, 512, 28, 4, False),
    ("l3.conv1", 1024, 256, 14, 5, True), ("l3.conv3", 256, 1024, 14, 6, False),
    ("l4.conv1", 2048, 512, 7, 2, True), ("l4.conv3", 512, 2048, 7, 3, False),
)


def variants(cin: int, cout: int, keep_input: bool, w: torch.Tensor, static_scale: float):
    """The three compiled functions of one shape (module docstring). ``w``: (cout, cin, 1, 1) FP32 weight."""
    w16 = w.to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    sw = (w.reshape(cout, cin).abs().amax(1, keepdim=True).clamp_min(1e-12) / FP8_MAX).float()  # (cout, 1)
    w8t = (w.reshape(cout, cin) / sw).clamp(-FP8_MAX, FP8_MAX).to(FP8).t()  # (cin, cout) column-major
    sw_row = sw.t().contiguous()  # (1, cout)
    sw_t = sw.amax().reshape(())
    w8t_t = (w.reshape(cout, cin) / sw_t).clamp(-FP8_MAX, FP8_MAX).to(FP8).t()
    s_static = torch.tensor(static_scale, device=w.device)

    def bf16(x):
        a = torch.relu(x)
        y = F.conv2d(a, w16)
        return (y, a) if keep_input else y

    def fp8_row(x):
        a = torch.relu(x)
        n, c, h, wd = a.shape
        a2 = a.permute(0, 2, 3, 1).reshape(-1, c)
        s = (a2.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX)
        q = (a2.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        y = torch._scaled_mm(q, w8t, s, sw_row, out_dtype=torch.bfloat16)
        y = y.view(n, h, wd, cout).permute(0, 3, 1, 2)
        return (y, a) if keep_input else y

    def fp8_static(x):
        a = torch.relu(x)
        n, c, h, wd = a.shape
        a2 = a.permute(0, 2, 3, 1).reshape(-1, c)
        q = (a2.float() / s_static).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        y = torch._scaled_mm(q, w8t_t, s_static, sw_t, out_dtype=torch.bfloat16)
        y = y.view(n, h, wd, cout).permute(0, 3, 1, 2)
        return (y, a) if keep_input else y

    return {"bf16": bf16, "fp8_row": fp8_row, "fp8_static": fp8_static}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    rows = []
    for name, cin, cout, hw, count, keep in SHAPES:
        x = torch.randn(args.batch, cin, hw, hw, device=dev).contiguous(memory_format=torch.channels_last)
        w = torch.randn(cout, cin, 1, 1, device=dev) / cin ** 0.5
        ref = F.conv2d(torch.relu(x), w)
        static_scale = float(torch.relu(x).abs().amax()) / FP8_MAX  # calibrated on this very batch
        xb = x.to(torch.bfloat16)
        fns, row = {}, {"name": name, "cin": cin, "cout": cout, "hw": hw, "count": count, "keep_input": keep}
        with torch.no_grad():
            for vname, fn in variants(cin, cout, keep, w, static_scale).items():
                try:
                    comp = torch.compile(fn)
                    out = comp(xb)
                    y = out[0] if keep else out
                    row[f"{vname}_rel_err"] = float((y.double() - ref.double()).norm() / ref.double().norm())
                    fns[vname] = (zoo.cuda_graph(comp, (xb,)), (xb,))
                except Exception as exc:  # noqa: BLE001 - recorded per variant
                    row[f"{vname}_error"] = zoo.one_line(exc)
            res = zoo.time_interleaved(fns, True, args.repeats, 0.05)
        for vname, r in res.items():
            row[f"{vname}_ms"] = r["ms"]
        rows.append(row)
        fns.clear()
        torch._dynamo.reset()
        print(json.dumps(row), flush=True)
    total = {v: sum(r.get(f"{v}_ms", float("nan")) * r["count"] for r in rows) for v in ("bf16", "fp8_row", "fp8_static")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_conv1x1.json").write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch, "rows": rows,
        "total_ms_weighted_by_count": total}, indent=1))
    print(f"{'shape':<10} {'cin':>5} {'cout':>5} {'hw':>3} {'n':>2} {'bf16 ms':>8} {'fp8row':>8} {'fp8stat':>8} "
          f"{'err row':>8} {'err stat':>8}")
    for r in rows:
        print(f"{r['name']:<10} {r['cin']:>5} {r['cout']:>5} {r['hw']:>3} {r['count']:>2} "
              f"{r.get('bf16_ms', float('nan')):>8.4f} {r.get('fp8_row_ms', float('nan')):>8.4f} "
              f"{r.get('fp8_static_ms', float('nan')):>8.4f} {r.get('fp8_row_rel_err', float('nan')):>8.1e} "
              f"{r.get('fp8_static_rel_err', float('nan')):>8.1e}")
    print("summed over ResNet-50's counts (ms):", {k: round(v, 3) for k, v in total.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
