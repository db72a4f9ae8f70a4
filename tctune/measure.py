"""Time a candidate and compare its outputs with the FP32 reference.

Timing protocol: warm-up, then several repeats of many iterations each,
timed with CUDA events on a GPU and ``time.perf_counter`` on the CPU; the reported time is the median
repeat. Peak memory comes from ``torch.cuda.max_memory_allocated`` (GPU only). An out-of-memory error is
caught, memory released, and a :class:`~tctune.errors.CandidateRejected` raised so the study goes on.

Comparison (:func:`compare`, :func:`check_accuracy`): every output is compared by its kind: floating
tensors by relative L2 and max-abs error (plus top-1 agreement and KL divergence where they look like
class logits), integer and bool tensors exactly (any mismatch rejects the candidate unless a rate is
allowed), Python values by ``==`` or relative error, and anything else counted as not checkable.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import statistics
import time
import warnings
from collections.abc import Mapping
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
    """How a candidate's outputs differ from the FP32 reference, by the kind of each output.

    Every leaf of the output pytree (tensors in dicts, tuples, lists, ``ModelOutput``/dataclass fields;
    see :func:`output_leaves`) is one *output*. Floating tensors (and Python floats) are compared by error,
    integer and bool tensors (and Python ints, bools, strings, ``None``) exactly; anything else is counted
    as not checkable, never as zero error.

    Attributes:
        max_abs_error: max |out - ref| over the floating outputs, in the outputs' units (0.0 when there
            are none: see ``float_outputs``).
        rel_l2_error: max over the floating outputs of ||out - ref||₂ / ||ref||₂ (computed in float64;
            0.0 when there are none).
        nonfinite: count of NaN/inf values in the candidate's floating outputs where the reference is finite
            (and of values other than the reference's own inf/NaN where it is not).
        float_outputs: floating outputs compared (None: not recorded, for stats built by hand).
        exact_outputs: integer/bool tensor and exact Python outputs compared element by element.
        mismatch_rate: max over the exact outputs of the fraction of elements that differ (0 to 1; a
            Python scalar counts as one element); None when there are no exact outputs.
        mismatched: elements that differ, summed over the exact outputs.
        logits_outputs: floating outputs that look like class logits (rank >= 2, last dim >= 2; see
            :func:`looks_like_logits`), for which ``top1_agreement`` and ``kl_divergence`` are computed.
        top1_agreement: min over those outputs of the fraction of rows (all but the last dim) whose
            argmax over the last dim is the same as the reference's (rows holding NaN/+inf count as
            disagreeing); None when there are none.
        kl_divergence: max over those outputs of the mean over rows of KL(softmax(ref) || softmax(out)),
            in nats, over rows free of NaN/+inf; None when there are none.
        unchecked_outputs: outputs that could not be compared (objects of unknown kind, or non-tensor
            outputs the candidate does not return in the same number); never counted as matching.
        fp64_ratio: when an FP64 reference was given to :func:`compare`: max over the floating outputs of
            RMSE(out, fp64) / (RMSE(base, fp64) + ``FP64_FLOOR`` · RMS(fp64)), where ``base`` is the FP32
            reference unless another baseline was given; None otherwise. See :func:`scaled_tolerance`.
    """

    max_abs_error: float
    rel_l2_error: float
    nonfinite: int
    float_outputs: int | None = None
    exact_outputs: int = 0
    mismatch_rate: float | None = None
    mismatched: int = 0
    logits_outputs: int = 0
    top1_agreement: float | None = None
    kl_divergence: float | None = None
    unchecked_outputs: int = 0
    fp64_ratio: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_metrics(self) -> dict:
        """The trial attributes these stats record (the names ``report.json``'s trial rows use):
        ``max_rel_error``, ``max_abs_error``, ``nonfinite`` as before, plus ``float_outputs``,
        ``exact_outputs``, ``mismatch_rate``, ``mismatched``, ``top1_agreement``, ``kl_divergence``,
        ``unchecked_outputs`` and ``fp64_ratio`` (meanings: the attributes of the same name)."""
        d = self.to_dict()
        d["max_rel_error"] = d.pop("rel_l2_error")
        return d


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


#: Calls timed one by one to size a timed repeat (:func:`_iterations_for`); the fastest of them is used.
CALIBRATION_CALLS = 3


def _iterations_for(fn: Callable[[], Any], device: torch.device, warmup: int, target_s: float,
                    max_iterations: int) -> int:
    """Warm ``fn`` up (``warmup`` calls, at least one), time :data:`CALIBRATION_CALLS` more calls one by one, and
    return how many calls of the fastest of them last about ``target_s`` seconds (1 to ``max_iterations``).

    The fastest, not one call: a single call held up by the host (a 16 ms stall of a 0.03 ms model on a loaded
    CPU) would otherwise shrink every repeat to a handful of calls that time the stall, not the model."""
    for _ in range(max(1, warmup)):
        fn()
    _sync(device)
    times = []
    for _ in range(CALIBRATION_CALLS):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    one = max(min(times), 1e-6)
    return int(min(max_iterations, max(1, target_s / one)))


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
            iters = _iterations_for(fn, device, warmup, target_repeat_s, max_iterations)
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


def output_leaves(out: Any) -> list[Any]:
    """The leaves of a (possibly nested) model output, in pytree order (``torch.utils._pytree``: dicts,
    tuples, lists, named tuples, and ``transformers`` ``ModelOutput``, which registers itself as a node).
    Dataclass instances and other mappings the pytree does not know are opened field by field / key by
    key, and NumPy arrays become tensors, so their contents are compared rather than left out."""
    leaves: list[Any] = []
    for x in tree_leaves(out):
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            leaves += output_leaves({f.name: getattr(x, f.name) for f in dataclasses.fields(x)})
        elif isinstance(x, Mapping):
            leaves += output_leaves(dict(x))
        elif type(x).__module__ == "numpy" and type(x).__name__ == "ndarray" and x.dtype.kind in "biufc":
            leaves.append(torch.from_numpy(x))
        else:
            leaves.append(x)
    return leaves


def float_leaves(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a (possibly nested) model output, in :func:`output_leaves` order."""
    return [t for t in output_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def looks_like_logits(t: torch.Tensor) -> bool:
    """Whether a floating output is treated as class logits (scores over the last dim): rank >= 2 and a
    last dim of at least 2. The rule is by shape only, so hidden states or images also qualify; the
    top-1 agreement and KL divergence they get are reported, never used as a limit by default."""
    return t.is_floating_point() and t.dim() >= 2 and t.shape[-1] >= 2


#: Python outputs compared with ``==`` (exactly); ``bool`` is an ``int``.
EXACT_TYPES = (int, str, bytes, type(None))

#: Floor of the FP64 rule's denominator, as a fraction of the FP64 output's RMS: dynamo's ``same`` adds
#: ``tol / 10`` (absolute, ``tol`` = 1e-4 by default) to the allowed RMSE; here it is relative to the
#: output's scale, so the rule does not depend on the outputs' units.
FP64_FLOOR = 1e-5


#: Elements per chunk of the float64 error computation (GPT-2's logits at batch 32 are 823 M values: the
#: error is computed on the outputs' device a chunk at a time, never as a whole float64 copy).
ERROR_CHUNK = 1 << 25


def _float_diff(o: torch.Tensor, r: torch.Tensor) -> tuple[float, float, float, int]:
    """``(sum (o - r)², sum r², max |o - r|, bad)`` in float64, chunked. ``bad`` counts NaN/inf in ``o``
    where ``r`` is finite, and values of ``o`` other than ``r``'s own inf/NaN where ``r`` is not finite;
    those pairs count as 0 in the sums (so a reference that masks with -inf can still be matched)."""
    o, r = o.detach().reshape(-1), r.detach().reshape(-1).to(o.device)
    num = torch.zeros((), dtype=torch.float64, device=o.device)
    den, mx = num.clone(), num.clone()
    bad = torch.zeros((), dtype=torch.int64, device=o.device)
    for i in range(0, o.numel(), ERROR_CHUNK):
        oc, rc = o[i:i + ERROR_CHUNK], r[i:i + ERROR_CHUNK]
        if oc.is_complex() or rc.is_complex():  # real and imaginary parts as two values each
            oc, rc = (torch.view_as_real(x.to(torch.complex128)) for x in (oc, rc))
        else:
            oc, rc = oc.double(), rc.double()
        fin, rfin = torch.isfinite(oc), torch.isfinite(rc)
        # NaN/inf where the reference is finite, or not the reference's own inf/NaN where it is not
        bad += (~fin & rfin).sum() + (~rfin & (oc != rc) & ~(torch.isnan(oc) & torch.isnan(rc))).sum()
        both = fin & rfin
        d = torch.where(both, oc, torch.zeros_like(oc)) - torch.where(rfin, rc, torch.zeros_like(rc))
        num += (d * d).sum()
        den += (torch.where(rfin, rc, torch.zeros_like(rc)) ** 2).sum()
        if d.numel():
            mx = torch.maximum(mx, d.abs().max())
    return float(num), float(den), float(mx), int(bad)


def _logits_agreement(o: torch.Tensor, r: torch.Tensor) -> tuple[float, float | None]:
    """(fraction of rows with the same argmax over the last dim, mean KL(softmax(r) || softmax(o)) in nats
    over rows free of NaN/+inf, None when no row is) of logits ``o`` against ``r``, chunked by rows."""
    agree, rows, kl, n = _logits_counts(o, r)
    return (agree / rows if rows else 1.0), (kl / n if n else None)


def _logits_counts(o: torch.Tensor, r: torch.Tensor) -> tuple[int, int, float, int]:
    """``(rows whose argmax agrees, rows, sum over valid rows of KL(softmax(r) || softmax(o)) in nats, valid
    rows)`` of logits ``o`` against ``r`` (rows: all but the last dim; valid: free of NaN/+inf on both sides)."""
    c = r.shape[-1]
    o2, r2 = o.detach().reshape(-1, c), r.detach().reshape(-1, c).to(o.device)
    rows = o2.shape[0]
    step = max(1, ERROR_CHUNK // (4 * c))  # a quarter chunk: its half-dozen float64 temporaries stay under 2 chunks
    agree = torch.zeros((), dtype=torch.int64, device=o.device)
    kl = torch.zeros((), dtype=torch.float64, device=o.device)
    valid = torch.zeros((), dtype=torch.int64, device=o.device)
    for i in range(0, rows, step):
        oc, rc = o2[i:i + step].double(), r2[i:i + step].double()
        ok = ~(torch.isnan(oc) | torch.isposinf(oc)).any(-1) & ~(torch.isnan(rc) | torch.isposinf(rc)).any(-1)
        agree += ((oc.argmax(-1) == rc.argmax(-1)) & ok).sum()
        lr, lo = rc.log_softmax(-1), oc.log_softmax(-1)
        p = lr.exp()
        # 0 · log 0 = 0 (a class the reference masks with -inf); p > 0 where the candidate has -inf: +inf
        term = torch.where(p > 0, p * (lr - lo), torch.zeros_like(p)).sum(-1)
        kl += torch.where(ok, term, torch.zeros_like(term)).sum()
        valid += ok.sum()
    return int(agree), rows, float(kl), int(valid)


def _exact_diff(o: torch.Tensor, r: torch.Tensor) -> int:
    """Elements of integer/bool ``o`` that differ from ``r`` (values compared, dtypes may differ)."""
    o, r = o.detach().reshape(-1), r.detach().reshape(-1).to(o.device)
    bad = torch.zeros((), dtype=torch.int64, device=o.device)
    for i in range(0, o.numel(), ERROR_CHUNK):
        bad += torch.ne(o[i:i + ERROR_CHUNK], r[i:i + ERROR_CHUNK]).sum()
    return int(bad)


def _same_value(o: Any, r: Any) -> bool:
    """``o == r`` for exact Python outputs, with ``True`` and ``1`` counted as different kinds."""
    try:
        eq = o == r
    except Exception:  # noqa: BLE001 - an object whose == raises: differs
        return False
    return isinstance(eq, bool) and eq and isinstance(o, bool) == isinstance(r, bool)


def compare(out: Any, ref: Any, ref64: Any = None, *, base: Any = None) -> ErrorStats:
    """Compare every output of ``out`` with ``ref`` (same structure), each by its kind.

    Outputs are the leaves of :func:`output_leaves`; tensors are paired in order, and so are non-tensor
    leaves (separately, so a runtime that returns only the tensors still has them checked).

    - Floating tensors: relative L2 and max-abs error, computed in float64 on ``out``'s device
      ``ERROR_CHUNK`` elements at a time (extra memory: a few float64 chunks, 256 MiB each, whatever the
      output size); NaN/inf in ``out`` count as 0 there and are counted in ``nonfinite``. Those that look
      like class logits (:func:`looks_like_logits`) also get top-1 agreement and the mean KL divergence
      of ``softmax(ref)`` from ``softmax(out)`` over the last dim.
    - Integer and bool tensors: exact; the fraction of differing elements is ``mismatch_rate``.
    - Python ints, bools, strings, bytes and ``None``: exact (``==``, one element each). Python floats and
      complex numbers: relative error ``|out - ref| / |ref|`` (absolute when ``ref`` is 0), folded into
      ``rel_l2_error``/``max_abs_error`` like a one-element tensor.
    - Anything else, or non-tensor leaves that ``out`` does not return in the same number as ``ref``:
      counted in ``unchecked_outputs``.

    Args:
        out: the candidate's outputs.
        ref: the FP32 reference outputs.
        ref64: optional: the outputs of the same model run in float64 on the same inputs (see
            :func:`fp64_reference`); when given, ``fp64_ratio`` is computed over the floating outputs.
        base: optional: the baseline whose own error against ``ref64`` scales the rule (default ``ref``).
            For a fp16/bf16 candidate this should be the model as written run at that precision (see
            :func:`scaled_tolerance`).

    Raises:
        CandidateRejected: the outputs differ in count, kind or shape (a broken rewrite).
        ValueError: ``ref64`` or ``base`` does not have ``ref``'s floating outputs (a caller's error).
    """
    outs, refs = output_leaves(out), output_leaves(ref)
    pairs = _tensor_pairs(outs, refs)
    stats = ErrorStats(max_abs_error=0.0, rel_l2_error=0.0, nonfinite=0, float_outputs=0)
    rates: list[float] = []
    tops: list[float] = []
    kls: list[float] = []
    floats: list[tuple[torch.Tensor, torch.Tensor]] = []
    for o, r in pairs:
        if r.is_floating_point() or r.is_complex():
            num, den, mx, bad = _float_diff(o, r)
            stats.float_outputs += 1
            stats.max_abs_error = max(stats.max_abs_error, mx)
            stats.rel_l2_error = max(stats.rel_l2_error, math.sqrt(num) / (math.sqrt(den) or 1.0))
            stats.nonfinite += bad
            if r.is_floating_point():
                floats.append((o, r))
            if looks_like_logits(r):
                top1, kl = _logits_agreement(o, r)
                stats.logits_outputs += 1
                tops.append(top1)
                if kl is not None:
                    kls.append(kl)
        else:
            bad = _exact_diff(o, r)
            stats.exact_outputs += 1
            stats.mismatched += bad
            rates.append(bad / r.numel() if r.numel() else 0.0)
    on = [x for x in outs if not isinstance(x, torch.Tensor)]
    rn = [x for x in refs if not isinstance(x, torch.Tensor)]
    if len(on) != len(rn):
        stats.unchecked_outputs += len(rn)
    else:
        for o, r in zip(on, rn):
            if isinstance(r, EXACT_TYPES):
                same = _same_value(o, r)
                stats.exact_outputs += 1
                stats.mismatched += not same
                rates.append(0.0 if same else 1.0)
            elif isinstance(r, (float, complex)) and isinstance(o, (int, float, complex)):
                stats.float_outputs += 1
                if o == r or (o != o and r != r):  # equal, or NaN where the reference is NaN
                    continue
                if not (math.isfinite(abs(o))):
                    stats.nonfinite += math.isfinite(abs(r))
                    continue
                d = abs(o - r)
                stats.max_abs_error = max(stats.max_abs_error, d)
                stats.rel_l2_error = max(stats.rel_l2_error, d / (abs(r) or 1.0))
            else:
                stats.unchecked_outputs += 1
    stats.mismatch_rate = max(rates) if rates else None
    stats.top1_agreement = min(tops) if tops else None
    stats.kl_divergence = max(kls) if kls else None
    if ref64 is not None:
        stats.fp64_ratio = _fp64_ratio(floats, ref, ref64, base)
    return stats


def _tensor_pairs(outs: list, refs: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The tensor leaves of a candidate's outputs paired in order with the reference's.

    Raises:
        CandidateRejected: they differ in count, kind (floating or not) or shape (a broken rewrite).
    """
    ot = [x for x in outs if isinstance(x, torch.Tensor)]
    rt = [x for x in refs if isinstance(x, torch.Tensor)]
    n_of, n_rf = (sum(t.is_floating_point() for t in ts) for ts in (ot, rt))
    if n_of != n_rf:
        raise CandidateRejected(f"candidate returns {n_of} floating outputs, the model {n_rf}")
    if len(ot) != len(rt):
        raise CandidateRejected(f"candidate returns {len(ot)} tensor outputs, the model {len(rt)}")
    for o, r in zip(ot, rt):
        if o.shape != r.shape:
            raise CandidateRejected(f"output shape {tuple(o.shape)} differs from the model's {tuple(r.shape)}")
        if (o.is_floating_point() or o.is_complex()) != (r.is_floating_point() or r.is_complex()):
            raise CandidateRejected(f"candidate returns a {o.dtype} output where the model returns {r.dtype}")
    return list(zip(ot, rt))


class PooledComparison:
    """:func:`compare` over several batches of one model's outputs, pooled as if they were one batch.

    Each :meth:`add` compares one batch (checked as :func:`compare` checks it); :meth:`stats` returns one
    :class:`ErrorStats` whose tensor figures are computed over the elements of every batch together: per
    output, the relative L2 error from the summed squared errors and summed squared reference values
    (float64), the mismatch rate from the summed differing and compared elements, top-1 agreement and mean
    KL divergence over the rows of every batch; then, as in :func:`compare`, the worst output. So for a model
    whose rows do not interact, the figures do not depend on how the rows were split into batches. Non-tensor
    outputs (Python values) are compared per batch and merged by the worst batch (largest errors and mismatch
    rate, summed mismatches).

    Attributes:
        batches: batches added; rows: rows counted (the ``rows``, else ``batch``, given to :meth:`add`).
    """

    def __init__(self) -> None:
        self.batches = 0
        self.rows = 0
        self._kinds: list[str] | None = None  # per tensor output: "float", "complex" or "exact"
        self._sums: list[list[float]] = []  # float/complex: [sum d², sum r², max |d|, nonfinite]; exact: [differ, n]
        self._logits: dict[int, list[float]] = {}  # output index -> [agreeing rows, rows, KL sum, valid rows]
        self._other: ErrorStats | None = None  # the non-tensor outputs, worst batch

    def add(self, out: Any, ref: Any, *, rows: int | None = None, batch: int | None = None) -> None:
        """Compare one batch: ``out`` (the candidate's outputs) with ``ref`` (the FP32 reference's).

        Args:
            batch: the batch size of this call (counted in :attr:`rows`; None: not counted).
            rows: a batch padded with repeated rows: only the first ``rows`` rows of every tensor output whose
                dim 0 is ``batch`` count (an output of another shape counts whole). Default: ``batch``.

        Raises:
            CandidateRejected: the outputs differ in count, kind or shape (a broken rewrite).
            ValueError: the outputs differ in kind from an earlier batch's (a caller's error).
        """
        outs, refs = output_leaves(out), output_leaves(ref)
        pairs = _tensor_pairs(outs, refs)
        kinds = ["complex" if r.is_complex() else "float" if r.is_floating_point() else "exact" for _, r in pairs]
        if self._kinds is None:
            self._kinds = kinds
            self._sums = [[0.0, 0.0, 0.0, 0] if k != "exact" else [0, 0] for k in kinds]
        elif kinds != self._kinds:
            raise ValueError(f"pooled batches must have outputs of the same kinds; got {kinds}, before {self._kinds}")
        keep = rows if rows is not None else batch
        for i, (o, r) in enumerate(pairs):
            if keep is not None and keep < batch and o.dim() and o.shape[0] == batch:
                o, r = o[:keep], r[:keep]
            acc = self._sums[i]
            if kinds[i] == "exact":
                acc[0] += _exact_diff(o, r)
                acc[1] += r.numel()
                continue
            num, den, mx, bad = _float_diff(o, r)
            acc[0] += num
            acc[1] += den
            acc[2] = max(acc[2], mx)
            acc[3] += bad
            if kinds[i] == "float" and looks_like_logits(r):
                agree, n, kl, valid = _logits_counts(o, r)
                lg = self._logits.setdefault(i, [0, 0, 0.0, 0])
                lg[0] += agree
                lg[1] += n
                lg[2] += kl
                lg[3] += valid
        rest = compare([x for x in outs if not isinstance(x, torch.Tensor)],
                       [x for x in refs if not isinstance(x, torch.Tensor)])
        self._other = rest if self._other is None else worst_stats(self._other, rest)
        self.batches += 1
        self.rows += keep or 0

    def stats(self) -> ErrorStats:
        """The pooled comparison (see the class docstring).

        Raises:
            ValueError: no batch was added.
        """
        if self._other is None:
            raise ValueError("no batch was compared")
        st = dataclasses.replace(self._other)
        rates = [] if st.mismatch_rate is None else [st.mismatch_rate]
        tops = [] if st.top1_agreement is None else [st.top1_agreement]
        kls = [] if st.kl_divergence is None else [st.kl_divergence]
        for i, (kind, acc) in enumerate(zip(self._kinds or [], self._sums)):
            if kind == "exact":
                st.exact_outputs += 1
                st.mismatched += int(acc[0])
                rates.append(acc[0] / acc[1] if acc[1] else 0.0)
                continue
            st.float_outputs += 1
            st.max_abs_error = max(st.max_abs_error, acc[2])
            st.rel_l2_error = max(st.rel_l2_error, math.sqrt(acc[0]) / (math.sqrt(acc[1]) or 1.0))
            st.nonfinite += int(acc[3])
            if i in self._logits:
                agree, n, kl, valid = self._logits[i]
                st.logits_outputs += 1
                tops.append(agree / n if n else 1.0)
                if valid:
                    kls.append(kl / valid)
        st.mismatch_rate = max(rates) if rates else None
        st.top1_agreement = min(tops) if tops else None
        st.kl_divergence = max(kls) if kls else None
        return st


def worst_stats(a: ErrorStats, b: ErrorStats) -> ErrorStats:
    """The element-wise worst of two comparisons of one candidate (e.g. random inputs and a real batch): the
    largest errors, mismatch rate, KL divergence and unchecked count, the lowest top-1 agreement, summed
    NaN/inf and mismatch counts; output counts are ``a``'s (the same model)."""
    def mx(x, y):
        return y if x is None else x if y is None else max(x, y)

    def mn(x, y):
        return y if x is None else x if y is None else min(x, y)

    out = dataclasses.replace(a)
    out.max_abs_error = max(a.max_abs_error, b.max_abs_error)
    out.rel_l2_error = max(a.rel_l2_error, b.rel_l2_error)
    out.nonfinite = a.nonfinite + b.nonfinite
    out.mismatched = a.mismatched + b.mismatched
    out.mismatch_rate = mx(a.mismatch_rate, b.mismatch_rate)
    out.top1_agreement = mn(a.top1_agreement, b.top1_agreement)
    out.kl_divergence = mx(a.kl_divergence, b.kl_divergence)
    out.unchecked_outputs = max(a.unchecked_outputs, b.unchecked_outputs)
    out.fp64_ratio = mx(a.fp64_ratio, b.fp64_ratio)
    return out


def _fp64_ratio(floats: list[tuple[torch.Tensor, torch.Tensor]], ref: Any, ref64: Any, base: Any) -> float:
    """Max over the floating outputs of RMSE(out, ref64) / (RMSE(base, ref64) + FP64_FLOOR · RMS(ref64))."""
    r64 = float_leaves(ref64)
    bs = float_leaves(ref if base is None else base)
    if len(r64) != len(floats) or len(bs) != len(floats):
        raise ValueError(f"the FP64 reference has {len(r64)} floating outputs and the baseline {len(bs)}, the FP32 "
                         f"reference {len(floats)}: run the same model on the same inputs for each")
    worst = 0.0
    for (o, _), b, e in zip(floats, bs, r64):
        if e.shape != o.shape or b.shape != o.shape:
            raise ValueError(f"FP64 reference / baseline output shapes {tuple(e.shape)} / {tuple(b.shape)} differ "
                             f"from {tuple(o.shape)}: run the same model on the same inputs for each")
        n = max(1, o.numel())
        num_o, den, _, bad = _float_diff(o, e)
        num_b, _, _, _ = _float_diff(b, e)
        if bad:
            return math.inf
        res_rmse, base_rmse, rms = (math.sqrt(x / n) for x in (num_o, num_b, den))
        allowed = base_rmse + FP64_FLOOR * rms
        ratio = res_rmse / allowed if allowed > 0 else (0.0 if res_rmse == 0 else math.inf)
        worst = max(worst, ratio)
    return worst


#: Multiplier of the FP64 rule (``torch._dynamo.utils.same``): a fp16/bf16 (and here fp8) candidate may
#: be 3x as far from FP64 as its baseline, anything else 2x (dynamo uses 3 rather than 2 for fp16/bf16 to
#: avoid false alarms on models whose AMP task accuracy is within 0.1 % of FP32).
FP64_MULTIPLIER = {"fp16": 3.0, "bf16": 3.0, "fp8": 3.0}


def fp64_multiplier(precision: str) -> float:
    """The FP64 rule's multiplier for ``precision``: 3.0 for fp16/bf16/fp8, 2.0 otherwise (see
    :data:`FP64_MULTIPLIER`). dynamo also raises it to 3.0 for outputs under 1000 elements; not done here."""
    return FP64_MULTIPLIER.get(precision, 2.0)


def scaled_tolerance(base_rmse: float, ref64_rms: float, precision: str) -> float:
    """Largest RMSE against the FP64 output a candidate at ``precision`` may have under the FP64 rule:
    ``fp64_multiplier(precision) · (base_rmse + FP64_FLOOR · ref64_rms)``, in the output's units.

    This is ``torch._dynamo.utils.same``'s rule with ``fp64_ref`` (there ``res_rmse <= multiplier ·
    ref_rmse + tol / 10``), with the additive floor made relative to the output's RMS. The limit scales
    with how sensitive the model is: a model whose baseline already drifts far from FP64 gets a wide
    limit, a well-conditioned one a tight limit. ``ErrorStats.fp64_ratio <= fp64_multiplier(precision)``
    is the same test for every floating output at once.

    How it would gate fp16/bf16 by default: run the model once in float64 (:func:`fp64_reference`) and
    once as written at the candidate's precision (``model.to(dtype)`` eager: what a user gets without
    tctune) per batch size, pass them as ``ref64`` and ``base`` to :func:`compare`, and call
    :func:`check_accuracy` with ``fp64_gate=True``. The baseline must be at the candidate's precision:
    with the FP32 reference as the baseline, FP32's own error against FP64 is about 1e-7 relative, and
    every bf16 candidate (about 4e-3) would be hundreds of times over the limit.

    Args:
        base_rmse: RMSE of the baseline's output against the FP64 output (output units).
        ref64_rms: RMS of the FP64 output (output units).
        precision: the candidate's precision name (``"fp16"``, ``"bf16"``, ...).
    """
    return fp64_multiplier(precision) * (base_rmse + FP64_FLOOR * ref64_rms)


def fp64_reference(model: torch.nn.Module, inputs: tuple) -> Any:
    """Outputs of a float64 copy of ``model`` on ``inputs`` with floating inputs cast to float64 (integer
    inputs unchanged), under ``torch.inference_mode``: the ``ref64`` of :func:`compare`. Costs a copy of
    the weights at twice their FP32 size, and a float64 forward pass (slow on GPUs without fast FP64)."""
    import copy

    m64 = copy.deepcopy(model).double()
    args = tuple(x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
    with torch.inference_mode():
        return m64(*args)


def check_accuracy(err: ErrorStats, precision: str, out: Any, *, max_mismatch_rate: float = 0.0,
                   fp64_gate: bool = False) -> None:
    """Reject a candidate whose outputs hold NaN/inf, whose integer/bool outputs differ from the FP32
    reference's in more than ``max_mismatch_rate`` of their elements, or (``fp64_gate``) whose error
    against FP64 is over the FP64 rule's limit.

    Args:
        err: the candidate's stats from :func:`compare`.
        precision: the candidate's precision, for the messages and the FP64 rule's multiplier.
        out: the candidate's outputs (for the largest finite value in the NaN/inf message).
        max_mismatch_rate: largest allowed ``err.mismatch_rate`` (0 to 1); 0.0: every integer/bool
            element must match exactly.
        fp64_gate: also require ``err.fp64_ratio <= fp64_multiplier(precision)`` where it was computed
            (see :func:`scaled_tolerance`).

    Raises:
        CandidateRejected: any of the above, naming the count and the limit.
    """
    if err.nonfinite:
        leaves = float_leaves(out)
        finite_max = max((float(t[torch.isfinite(t)].abs().max()) for t in leaves if torch.isfinite(t).any()), default=0.0)
        limit = " (fp16 max is 65504)" if precision == "fp16" else ""
        raise CandidateRejected(f"{precision} output has {err.nonfinite} NaN/inf values; max finite |x| {finite_max:.3g}{limit}")
    if err.mismatch_rate is not None and err.mismatch_rate > max_mismatch_rate:
        raise CandidateRejected(
            f"{precision} integer/bool outputs differ from FP32 in {err.mismatch_rate:.2%} of their elements "
            f"({err.mismatched} element{'s' if err.mismatched != 1 else ''}) > allowed mismatch rate {max_mismatch_rate:g} (class ids or counts changed; "
            "raise the allowed mismatch rate to accept this)")
    if fp64_gate and err.fp64_ratio is not None and err.fp64_ratio > fp64_multiplier(precision):
        raise CandidateRejected(
            f"{precision} error against FP64 is {err.fp64_ratio:.3g}x the baseline's (FP64 rule limit "
            f"{fp64_multiplier(precision):g}x)")


def time_interleaved(fns: Mapping[Any, Callable[[], Any]], device: torch.device, *, rounds: int = 15,
                     target_block_s: float = 0.05, max_iterations: int = 200, warmup: int = 3,
                     contexts: Mapping[Any, Callable[[], Any]] | None = None,
                     on_round: Callable[[int], None] | None = None) -> dict[Any, list[float]]:
    """Time several callables side by side: every round times each once, in the given order (A B C A B C …),
    so a change of clock or load during the comparison affects them alike (PyTorch's benchmark harness
    interleaves its runs for the same reason).

    Each callable is warmed up (``warmup`` calls), then given a fixed number of calls per block so that one
    block lasts about ``target_block_s`` (at most ``max_iterations``); a block is timed with CUDA events on a
    GPU and ``time.perf_counter`` on the CPU, under ``torch.inference_mode``.

    Args:
        fns: key -> callable running one call (one batch) on pre-built inputs.
        device: where they run.
        rounds: rounds (values per key).
        contexts: key -> a context manager factory entered around that key's warm-up and each of its blocks
            (e.g. ``lambda: precision_mode("tf32")``); None: none.
        on_round: called after each round with its index (e.g. to sample GPU clocks).

    Returns:
        key -> ms per call, one value per round.

    Raises:
        CandidateRejected: out of memory (memory is released first).
    """
    cuda = device.type == "cuda"
    iters: dict[Any, int] = {}

    def ctx(k):
        return contexts[k]() if contexts and k in contexts else contextlib.nullcontext()

    out: dict[Any, list[float]] = {k: [] for k in fns}
    try:
        with torch.inference_mode():
            for k, fn in fns.items():
                with ctx(k):
                    iters[k] = _iterations_for(fn, device, warmup, target_block_s, max_iterations)
            for r in range(rounds):
                for k, fn in fns.items():
                    n = iters[k]
                    with ctx(k):
                        out[k].append(_block_ms(fn, n, cuda))
                if on_round is not None:
                    on_round(r)
    except Exception as exc:
        if is_oom(exc):
            release_memory(device)
            raise CandidateRejected(f"out of memory in the side-by-side timing: {str(exc).splitlines()[0][:200]}") from exc
        raise
    return out


def _block_ms(fn: Callable[[], Any], n: int, cuda: bool) -> float:
    """Mean ms per call of ``n`` calls of ``fn`` timed as one block."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) * 1e3 / n
