"""Would cuDNN's fused convolution + bias (+ residual add) + ReLU kernels speed up ResNet-50 past Inductor?

A probe before building a pass. After BatchNorm folding, every convolution of ResNet-50 is followed by its bias
and a ReLU, and each bottleneck's last convolution by the residual add and a ReLU. Inductor runs the convolution
as an extern cuDNN call and the ReLU (and add) as a separate Triton kernel that reads and writes the activation
once more. PyTorch exposes cuDNN's fused kernels as ``aten.cudnn_convolution_relu`` and
``aten.cudnn_convolution_add_relu`` (CUDA only, no meta kernel). This probe times torchvision's ResNet-50 (random
weights, BatchNorm folded by hand, fp16, channels-last, one batch), each variant captured as one CUDA graph
(``zoo.cuda_graph``) and timed interleaved (``zoo.time_interleaved``: CUDA events, median of repeats):

- ``eager_plain``: the folded network, ``conv2d`` + ``relu`` (+ add) as separate ops, eager;
- ``eager_fused``: the same with the two fused cuDNN ops, eager;
- ``inductor_plain``: ``torch.compile`` of ``eager_plain``'s function (mode default);
- ``inductor_fused``: ``torch.compile`` of the fused function, the cuDNN ops wrapped as ``torch.library``
  custom ops with a fake implementation (how a graph pass would hand them to Inductor);
- ``inductor_half``: ``torch.compile(torchvision model.half())`` (channels-last), the plain baseline;
- ``tctune``: ``torch.compile(model, backend="tctune", options={"precision": "fp16", "policy": "pure"})``.

Relative L2 error of each output against the FP32 eager model on the same input is recorded.

Output: ``--out``/``cudnn_fused_conv.json`` and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchload import load_benchmark

zoo = load_benchmark("zoo")


def fold(conv, bn):
    """``(weight, bias)`` of ``conv`` followed by eval-mode ``bn``, FP32."""
    s = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    w = conv.weight * s.reshape(-1, 1, 1, 1)
    b = bn.bias - bn.running_mean * s
    return w.detach(), b.detach()


def folded_net(model, dtype):
    """The folded network as a flat list of layers: dicts with weight, bias, stride, padding (channels-last)."""
    def cv(conv, bn):
        w, b = fold(conv, bn)
        return {"w": w.to(dtype).contiguous(memory_format=torch.channels_last), "b": b.to(dtype),
                "stride": list(conv.stride), "padding": list(conv.padding)}
    stem = cv(model.conv1, model.bn1)
    blocks = []
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        for blk in layer:
            blocks.append({"c1": cv(blk.conv1, blk.bn1), "c2": cv(blk.conv2, blk.bn2), "c3": cv(blk.conv3, blk.bn3),
                           "down": cv(blk.downsample[0], blk.downsample[1]) if blk.downsample is not None else None})
    fc = (model.fc.weight.detach().to(dtype), model.fc.bias.detach().to(dtype))
    return stem, blocks, fc


def make_forward(net, conv_relu, conv_add_relu, conv):
    stem, blocks, fc = net

    def forward(x):
        h = conv_relu(x, stem)
        h = F.max_pool2d(h, 3, 2, 1)
        for blk in blocks:
            idt = conv(h, blk["down"]) if blk["down"] is not None else h
            t = conv_relu(h, blk["c1"])
            t = conv_relu(t, blk["c2"])
            h = conv_add_relu(t, blk["c3"], idt)
        h = torch.flatten(F.adaptive_avg_pool2d(h, 1), 1)
        return F.linear(h, *fc)
    return forward


def plain_ops():
    def conv(x, c):
        return F.conv2d(x, c["w"], c["b"], c["stride"], c["padding"])

    def conv_relu(x, c):
        return torch.relu(conv(x, c))

    def conv_add_relu(x, c, z):
        return torch.relu(conv(x, c) + z)
    return conv_relu, conv_add_relu, conv


def fused_ops(wrapped: bool):
    aten = torch.ops.aten
    if wrapped:
        @torch.library.custom_op("tctune_probe::conv_relu", mutates_args=())
        def op_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, stride: list[int],
                    padding: list[int]) -> torch.Tensor:
            return aten.cudnn_convolution_relu(x, w, b, stride, padding, [1, 1], 1)

        @op_relu.register_fake
        def _(x, w, b, stride, padding):
            return F.conv2d(x, w, b, stride, padding)

        @torch.library.custom_op("tctune_probe::conv_add_relu", mutates_args=())
        def op_add_relu(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor, b: torch.Tensor, stride: list[int],
                        padding: list[int]) -> torch.Tensor:
            return aten.cudnn_convolution_add_relu(x, w, z, 1.0, b, stride, padding, [1, 1], 1)

        @op_add_relu.register_fake
        def _(x, w, z, b, stride, padding):
            return F.conv2d(x, w, b, stride, padding)
    else:
        def op_relu(x, w, b, stride, padding):
            return aten.cudnn_convolution_relu(x, w, b, stride, padding, [1, 1], 1)

        def op_add_relu(x, w, z, b, stride, padding):
            return aten.cudnn_convolution_add_relu(x, w, z, 1.0, b, stride, padding, [1, 1], 1)

    def conv(x, c):
        return F.conv2d(x, c["w"], c["b"], c["stride"], c["padding"])

    def conv_relu(x, c):
        return op_relu(x, c["w"], c["b"], c["stride"], c["padding"])

    def conv_add_relu(x, c, z):
        return op_add_relu(x, c["w"], z, c["b"], c["stride"], c["padding"])
    return conv_relu, conv_add_relu, conv


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--no-tctune", action="store_true")
    args = p.parse_args(argv)
    import torchvision
    dev, dt = "cuda", torch.float16
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval().to(dev)
    for m in model.modules():  # non-trivial BatchNorm statistics, so folding is exercised
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.1, 0.1)
    x32 = torch.randn(args.batch, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
    x = x32.to(dt)
    with torch.no_grad():
        ref = model(x32).double()
    net = folded_net(model, dt)
    rows, fns = {}, {}

    def add(name, fn, inp):
        try:
            with torch.no_grad():
                out = fn(inp)
                rows[name] = {"rel_err": float((out.double() - ref).norm() / ref.norm())}
                fns[name] = (zoo.cuda_graph(fn, (inp,)), (inp,))
        except Exception as exc:  # noqa: BLE001 - recorded per variant
            rows[name] = {"error": zoo.one_line(exc)}
        print(name, rows[name], flush=True)

    add("eager_plain", make_forward(net, *plain_ops()), x)
    add("eager_fused", make_forward(net, *fused_ops(False)), x)
    add("inductor_plain", torch.compile(make_forward(net, *plain_ops())), x)
    add("inductor_fused", torch.compile(make_forward(net, *fused_ops(True))), x)
    import copy  # `model` itself stays FP32: it is the reference and tctune's input
    half = copy.deepcopy(model).half().to(memory_format=torch.channels_last)
    add("inductor_half", torch.compile(half), x)
    if not args.no_tctune:
        import tctune.backend as tb  # the entry point registers "tctune" only where the package is installed
        backend = "tctune" if "tctune" in torch._dynamo.list_backends() else tb.tctune_backend
        add("tctune", torch.compile(copy.deepcopy(model).to(memory_format=torch.channels_last), backend=backend,
                                    options={"precision": "fp16", "policy": "pure"}), x32)
    with torch.no_grad():
        res = zoo.time_interleaved(fns, True, args.repeats, 0.1)
    for n, r in res.items():
        rows[n].update(ms=r["ms"], repeats_ms=r["repeats_ms"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cudnn_fused_conv.json").write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(), "batch": args.batch, "variants": rows}, indent=1))
    base = rows.get("inductor_plain", {}).get("ms")
    print(f"{'variant':<16} {'ms':>8} {'x inductor_plain':>17} {'rel err':>9}")
    for n, r in rows.items():
        ms = r.get("ms")
        print(f"{n:<16} {ms if ms is not None else float('nan'):>8.3f} "
              f"{(base / ms) if (ms and base) else float('nan'):>17.3f} {r.get('rel_err', float('nan')):>9.2e} "
              f"{r.get('error', '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
