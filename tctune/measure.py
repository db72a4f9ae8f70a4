"""Time a candidate and compare its output with the FP32 reference.

Protocol: warm-up, then several repeats of many iterations each,
timed with CUDA events on a GPU and ``time.perf_counter`` on the CPU; the reported time is the median
repeat. Peak memory comes from ``torch.cuda.max_memory_allocated`` (GPU only). An out-of-memory error is
caught, memory released, and a :class:`~tctune.errors.CandidateRejected` raised so the study goes on.
"""
from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from .errors import CandidateRejected


@dataclass
class Timing:
    """Median time of one call and what it implies.

    Attributes:
        latency_ms: median over repeats of the mean time of one call (one batch), in ms.
        throughput: items per second (``batch_size / latency``).
        repeats_ms: per-repeat mean call time, ms (for spread).
        peak_memory_mib: peak CUDA memory allocated during timing, MiB; None on the CPU.
        iterations: calls per repeat.
        latency_p50_ms, latency_p99_ms: percentiles of single calls timed one by one (each with its own
            CUDA event pair or perf_counter pair), ms; the p99 of a few dozen calls is their maximum or near it.
    """

    latency_ms: float
    throughput: float
    repeats_ms: list[float]
    peak_memory_mib: float | None
    iterations: int
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ErrorStats:
    """Error of a candidate's outputs against the FP32 reference (all floating outputs, flattened).

    Attributes:
        max_abs_error: max |out - ref|.
        rel_l2_error: max over outputs of ||out - ref||₂ / ||ref||₂ (computed in float64).
        nonfinite: count of NaN/inf values in the candidate's outputs.
    """

    max_abs_error: float
    rel_l2_error: float
    nonfinite: int

    def to_dict(self) -> dict:
        return asdict(self)


@contextlib.contextmanager
def precision_mode(precision: str):
    """Set TF32 for matmul and cuDNN on (``"tf32"``) or off (everything else), restoring it afterwards.

    FP32 means IEEE FP32 here: TF32 is its own, searched precision.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        on = precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(exc: BaseException) -> bool:
    """True for CUDA (or CPU allocator) out-of-memory errors."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def release_memory(device: torch.device) -> None:
    """Free what a failed candidate left behind."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_call(
    fn: Callable[[], Any],
    batch_size: int,
    device: torch.device,
    *,
    warmup: int = 3,
    repeats: int = 5,
    target_repeat_s: float = 0.1,
    max_iterations: int = 200,
    single_calls: int = 30,
    grad: bool = False,
    on_repeat: Callable[[int, float], None] | None = None,
) -> Timing:
    """Time ``fn`` (one batch per call) by the protocol above.

    Args:
        fn: runs the candidate once on pre-built inputs.
        batch_size: items per call, for throughput.
        device: where ``fn`` runs (``cuda`` → CUDA events, else ``perf_counter``).
        warmup: calls before timing (also triggers cuDNN autotuning and lazy init).
        repeats: timed repeats; the median is reported.
        target_repeat_s: iterations per repeat are chosen so a repeat lasts about this long.
        max_iterations: cap on iterations per repeat.
        single_calls: calls timed one at a time for the latency percentiles (0: skip).
        grad: run with autograd on (training steps); otherwise under ``torch.inference_mode``.
        on_repeat: called after each repeat with ``(repeat index, items/s so far)`` (median of the repeats
            done); it may raise (e.g. ``optuna.TrialPruned``) to stop a candidate that is clearly worse.

    Raises:
        CandidateRejected: out of memory (memory is released first).
    """
    cuda = device.type == "cuda"
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        with contextlib.nullcontext() if grad else torch.inference_mode():
            for _ in range(max(1, warmup)):
                fn()
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            one = max(time.perf_counter() - t0, 1e-6)
            iters = int(min(max_iterations, max(1, target_repeat_s / one)))
            samples = []
            for rep in range(repeats):
                if rep and on_repeat is not None:
                    on_repeat(rep - 1, batch_size / (statistics.median(samples) / 1e3))
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(iters):
                        fn()
                    end.record()
                    end.synchronize()
                    samples.append(start.elapsed_time(end) / iters)
                else:
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        fn()
                    samples.append((time.perf_counter() - t0) * 1e3 / iters)
            singles = _single_call_ms(fn, device, single_calls)
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    except Exception as exc:
        if is_oom(exc):
            release_memory(device)
            raise CandidateRejected(f"out of memory at batch size {batch_size}: {str(exc).splitlines()[0][:200]}") from exc
        raise
    med = statistics.median(samples)
    return Timing(latency_ms=med, throughput=batch_size / (med / 1e3), repeats_ms=samples,
                  peak_memory_mib=peak, iterations=iters,
                  latency_p50_ms=percentile(singles, 50), latency_p99_ms=percentile(singles, 99))


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def _single_call_ms(fn: Callable[[], Any], device: torch.device, n: int) -> list[float]:
    """Time ``n`` calls one by one (ms each). On CUDA each call gets its own event pair, synchronized once."""
    if n <= 0:
        return []
    if device.type == "cuda":
        pairs = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            pairs.append((a, b))
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) for a, b in pairs]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def float_leaves(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a (possibly nested) model output, in pytree order."""
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


#: Elements per chunk of the float64 error computation (GPT-2's logits at batch 32 are 823 M values: the
#: error is computed on the outputs' device a chunk at a time, never as a whole float64 copy).
ERROR_CHUNK = 1 << 25


def compare(out: Any, ref: Any) -> ErrorStats:
    """Error of ``out`` against ``ref`` (same structure), over every floating output tensor.

    Computed in float64 on ``out``'s device, ``ERROR_CHUNK`` elements at a time (extra memory: a few chunks
    of float64, 256 MiB each, whatever the output size). ``rel_l2_error`` is the largest over the outputs of
    ``||out - ref||_2 / ||ref||_2`` (NaN/inf in ``out`` count as 0 there and are counted in ``nonfinite``);
    ``max_abs_error`` the largest absolute difference.

    Raises:
        CandidateRejected: the outputs differ in count or shape (a broken rewrite).
    """
    outs, refs = float_leaves(out), float_leaves(ref)
    if len(outs) != len(refs):
        raise CandidateRejected(f"candidate returns {len(outs)} floating outputs, the model {len(refs)}")
    max_abs, rel, nonfinite = 0.0, 0.0, 0
    for o, r in zip(outs, refs):
        if o.shape != r.shape:
            raise CandidateRejected(f"output shape {tuple(o.shape)} differs from the model's {tuple(r.shape)}")
        o, r = o.detach().reshape(-1), r.detach().reshape(-1).to(o.device)
        num = torch.zeros((), dtype=torch.float64, device=o.device)
        den, mx = num.clone(), num.clone()
        bad = torch.zeros((), dtype=torch.int64, device=o.device)
        for i in range(0, o.numel(), ERROR_CHUNK):
            oc, rc = o[i:i + ERROR_CHUNK].double(), r[i:i + ERROR_CHUNK].double()
            fin = torch.isfinite(oc)
            bad += (~fin).sum()
            d = torch.where(fin, oc, torch.zeros_like(oc)) - rc
            num += (d * d).sum()
            den += (rc * rc).sum()
            mx = torch.maximum(mx, d.abs().max())
        max_abs = max(max_abs, float(mx))
        rel = max(rel, math.sqrt(float(num)) / (math.sqrt(float(den)) or 1.0))
        nonfinite += int(bad)
    return ErrorStats(max_abs_error=max_abs, rel_l2_error=rel, nonfinite=nonfinite)


def check_accuracy(err: ErrorStats, precision: str, out: Any) -> None:
    """Reject a candidate whose outputs hold NaN/inf, naming the count and the fp16 limit when relevant.

    Raises:
        CandidateRejected: ``err.nonfinite > 0``.
    """
    if err.nonfinite:
        leaves = float_leaves(out)
        finite_max = max((float(t[torch.isfinite(t)].abs().max()) for t in leaves if torch.isfinite(t).any()), default=0.0)
        limit = " (fp16 max is 65504)" if precision == "fp16" else ""
        raise CandidateRejected(f"{precision} output has {err.nonfinite} NaN/inf values; max finite |x| {finite_max:.3g}{limit}")
