"""How a candidate is executed: eagerly, replayed as a CUDA graph, or compiled by Inductor.

These are the execution-backend choices of the search (``--runtimes``). They wrap a callable
``fn(*inputs)`` (the user's model, or tctune's rewritten graph) without changing its numbers:

- ``eager``: call it as it is.
- ``cudagraphs``: capture one CUDA graph for the trial's fixed batch size and replay it; inputs are copied
  into the graph's static buffers on every call (that copy is part of the measured time). Removes CPU
  launch overhead, which dominates small batches.
- ``inductor``: ``torch.compile`` (mode ``default`` or ``max-autotune-no-cudagraphs``); the compile time is
  measured on its own and bounded by ``--compile-budget``. fp16 ``torch.compile`` of BERT-large ran
  955 seq/s against 1,797 for fp16 eager on the H200 (benchmarks/NOTES.md, reference measurements): never
  assume compiling wins.
- ``inductor-cudagraphs``: the Inductor-compiled callable (mode ``default``) captured as one CUDA graph and
  replayed like ``cudagraphs``: inference only. On the H200 this was the fastest way to run tctune's graph on
  all five suite models (benchmarks/NOTES.md, the entry "tctune's graph through Inductor"), e.g. seed CNN 0.134 ms vs
  0.187 ms Inductor alone, BERT-base 3.31 vs 3.50 ms.
- ``inductor-max-autotune`` / ``inductor-max-autotune-cudagraphs``: the same two with Inductor's mode
  ``max-autotune-no-cudagraphs`` (``max_autotune``: Triton GEMM/conv templates benchmarked per shape, epilogues
  such as a GELU fused into the GEMM; ``coordinate_descent_tuning``). Its compile takes much longer, so the
  search does not sample it by default: after the trials, the best tctune candidate through ``inductor`` /
  ``inductor-cudagraphs`` is rebuilt with its max-autotune variant (:data:`MAX_AUTOTUNE_VARIANT`) when the
  compile budget allows (:mod:`tctune.search.autotune`). ``inductor-max-autotune-cudagraphs`` is inference on a
  CUDA GPU only, like ``inductor-cudagraphs``.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

RUNTIMES_GPU = ("eager", "cudagraphs", "inductor", "inductor-cudagraphs")
RUNTIMES_CPU = ("eager",)
ALL_RUNTIMES = ("eager", "cudagraphs", "inductor", "inductor-max-autotune", "inductor-cudagraphs",
                "inductor-max-autotune-cudagraphs")
#: Runtimes that replay a CUDA graph (inference on a CUDA GPU only).
CUDA_GRAPH_RUNTIMES = ("cudagraphs", "inductor-cudagraphs", "inductor-max-autotune-cudagraphs")
#: Runtimes that compile with Inductor (``torch.compile``); their compile is bounded by ``--compile-budget``.
INDUCTOR_RUNTIMES = ("inductor", "inductor-max-autotune", "inductor-cudagraphs", "inductor-max-autotune-cudagraphs")
#: The max-autotune variant of each default-mode Inductor runtime: what the search's max-autotune finalist step
#: rebuilds a candidate with (:mod:`tctune.search.autotune`).
MAX_AUTOTUNE_VARIANT = {"inductor": "inductor-max-autotune", "inductor-cudagraphs": "inductor-max-autotune-cudagraphs"}
#: The ``torch.compile`` mode of the max-autotune runtimes: max-autotune without Inductor's own CUDA graphs (a
#: ``-cudagraphs`` runtime captures one itself, :class:`CudaGraphed`, as ``inductor-cudagraphs`` does).
MAX_AUTOTUNE_MODE = "max-autotune-no-cudagraphs"


def inductor_mode(runtime: str) -> str | None:
    """The ``torch.compile`` mode of ``runtime``: :data:`MAX_AUTOTUNE_MODE` for the max-autotune runtimes,
    ``"default"`` for the other Inductor runtimes, None for ``eager`` / ``cudagraphs`` (no compile)."""
    if runtime not in INDUCTOR_RUNTIMES:
        return None
    return MAX_AUTOTUNE_MODE if "max-autotune" in runtime else "default"


def without_cuda_graph(runtime: str) -> str:
    """``runtime`` without its CUDA graph (what runs where no CUDA graph can, e.g. on CPU inputs):
    ``cudagraphs`` -> ``eager``, ``inductor[-max-autotune]-cudagraphs`` -> ``inductor[-max-autotune]``; any other
    runtime is returned as it is."""
    if runtime == "cudagraphs":
        return "eager"
    return runtime.removesuffix("-cudagraphs")


def aot_inductor_configs(runtime: str) -> dict[str, Any]:
    """The ``torch._inductor.config`` options an AOTInductor package of a trial measured through ``runtime`` is
    compiled with, so the engine compiles as the measured candidate did: the options of torch.compile's mode
    :data:`MAX_AUTOTUNE_MODE` (``torch._inductor.list_mode_options``: ``max_autotune`` and
    ``coordinate_descent_tuning`` in torch 2.13) for the max-autotune runtimes; ``{}`` (Inductor's defaults) for
    every other runtime."""
    if inductor_mode(runtime) != MAX_AUTOTUNE_MODE:
        return {}
    import torch._inductor

    return dict(torch._inductor.list_mode_options(MAX_AUTOTUNE_MODE))


class Autocast(torch.nn.Module):
    """Plain AMP: the user's eager model under ``torch.autocast`` (the baseline users try by hand)."""

    def __init__(self, model: Callable, dtype: torch.dtype, device_type: str):
        super().__init__()
        self.model, self.dtype, self.device_type = model, dtype, device_type

    def forward(self, *args, **kwargs):  # keywords too: a score(model) calls it as the model is called
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.model(*args, **kwargs)


class ChannelsLast(torch.nn.Module):
    """A module converted to channels-last (NHWC) weights; 4-D floating inputs (positional or keyword) are
    converted on every call (that copy is part of the measured time)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        def nhwc(a):
            return (a.contiguous(memory_format=torch.channels_last)
                    if isinstance(a, torch.Tensor) and a.dim() == 4 and a.is_floating_point() else a)

        return self.module(*(nhwc(a) for a in args), **{k: nhwc(v) for k, v in kwargs.items()})


class CudaGraphed:
    """Replay ``fn`` as one CUDA graph captured on ``example_inputs`` (same shapes on every call).

    Args:
        fn: the candidate; must be capturable (no host sync, no dynamic shapes inside).
        example_inputs: tensors on the GPU with the shapes every later call uses.

    Raises:
        RuntimeError: capture failed (e.g. the model synchronizes with the host); the caller rejects the trial.
    """

    def __init__(self, fn: Callable, example_inputs: tuple[torch.Tensor, ...]):
        self.static_inputs = tuple(x.clone() for x in example_inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(3):  # warm-up outside the graph (cuBLAS handles, lazy init, cuDNN autotune)
                fn(*self.static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.static_output = fn(*self.static_inputs)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        for dst, src in zip(self.static_inputs, inputs):
            if dst is not src:
                dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.static_output


def wrap(fn: Callable, runtime: str, inputs: tuple[torch.Tensor, ...]) -> tuple[Callable, float]:
    """Wrap ``fn`` for ``runtime``; returns ``(callable, setup_seconds)``.

    The setup time is the CUDA graph capture or the Inductor compile (the first call), in seconds. An Inductor
    runtime compiles with :func:`inductor_mode`'s mode; a ``-cudagraphs`` one then captures the compiled callable
    as one CUDA graph (:class:`CudaGraphed`).

    Raises:
        ValueError: unknown runtime.
        RuntimeError: capture/compile failed (the caller rejects the trial with the reason).
    """
    if runtime == "eager":
        return fn, 0.0
    t0 = time.perf_counter()
    if runtime == "cudagraphs":
        out = CudaGraphed(fn, inputs)
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0
    if runtime in INDUCTOR_RUNTIMES:
        compiled = torch.compile(fn, mode=inductor_mode(runtime), dynamic=False)
        with torch.inference_mode():
            compiled(*inputs)  # compile now, so it is not timed as a call
        if inputs and inputs[0].is_cuda:
            torch.cuda.synchronize()
        if runtime in CUDA_GRAPH_RUNTIMES:
            compiled = CudaGraphed(compiled, inputs)
            torch.cuda.synchronize()
        return compiled, time.perf_counter() - t0
    raise ValueError(f"unknown runtime {runtime!r}; choose from {', '.join(ALL_RUNTIMES)}")


def detach_outputs(out: Any) -> Any:
    """Clone tensor outputs (a CUDA graph's static output is overwritten by the next replay)."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)
