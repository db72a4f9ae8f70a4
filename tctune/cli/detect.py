"""``tctune detect``: the GPU(s), compute capability, Tensor Core precisions and alignment."""
from __future__ import annotations

import json


def register(sub) -> str:
    """Add the ``detect`` subcommand; returns its name."""
    d = sub.add_parser("detect", help="show the GPU(s), compute capability, Tensor Core precisions and alignment",
                       description="Find NVIDIA GPUs (cuda-python driver API; NVML for clocks and power; torch as a "
                                   "fallback) and print what tctune will plan for. With no GPU it says so and exits 0.")
    d.add_argument("--json", action="store_true", help="print JSON instead of text")
    d.add_argument("--target", metavar="NAME", help="describe a GPU you don't have: sm_XX or a name (v100, t4, a100, a10, l4, l40s, h100, h200, ...)")
    d.add_argument("--debug", action="store_true", help="show tracebacks")

    return "detect"


def run(args) -> int:
    from ..hardware import describe, detect, resolve
    specs = [resolve(args.target)] if args.target else detect()
    if args.json:
        from ..hardware import no_gpu_reason
        payload = {"gpus": [s.to_dict() for s in specs]}
        if not specs:
            from ..hardware import _cpu_spec

            payload["reason"] = no_gpu_reason()
            payload["cpu"] = _cpu_spec().to_dict()  # what `tctune optimize` plans for and measures on here
        print(json.dumps(payload if not args.target else specs[0].to_dict(), indent=2))
    else:
        print(describe(specs))
    return 0
