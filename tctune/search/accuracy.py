"""The user's accuracy contract during the search: the score gate (:class:`ScoreGate`), the seeded random rows
every inference candidate is compared on whatever batch size it is timed at (:class:`CheckSet`), and the
worst-case merge of error statistics over the random and the real inputs (:func:`worst`).

When the model file (or the Python API's :class:`~tctune.modelfile.ModelFile`) gives ``score(model) -> float``
(higher is better), the score decides whether a precision choice is accurate enough: a candidate is feasible
when its score is at least :attr:`ScoreGate.limit`: ``min_score`` when given, else
``fp32 - (1 - min_score_ratio) * |fp32|`` (``0.99 * fp32`` by default for a positive FP32 score: MLPerf
Inference's "99 % of FP32" accuracy target). Relative L2 error on random inputs is then reported but does not
reject; NaN/inf outputs and integer/bool mismatches still do (``tctune.measure.check_accuracy``).

What ``score`` receives: the FP32 model once, then each candidate's *built* module on the measuring device —
tctune's rewritten graph (a ``torch.fx.GraphModule``) or the model as written (under ``torch.autocast`` at
fp16/bf16) — before the runtime wrapper (eager, CUDA graph or Inductor: those are shape-specialized and do
not change what a precision choice computes), under the candidate's precision mode (TF32 on for tf32 only)
and ``torch.inference_mode``. ``score`` does its own batching and must move its data to the device of the
model's parameters. Calls are cached per built graph: the key is the trial's :class:`~tctune.trial.TrialParams`
without runtime and batch size, so one graph is scored once whatever runtime or batch size it is timed at
(at fp16 the graph of the first batch size measured is scored: its overflow calibration saw that batch).
"""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import replace
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

import torch

from ..errors import CandidateRejected, ModelFileError, UsageError
from ..measure import precision_mode, worst_stats
from ..trial import FailureKind, TrialParams, reference_inputs
from .config import DEFAULT_MIN_SCORE_RATIO


def graph_key(trial: TrialParams) -> Hashable:
    """The identity of a trial's built graph: its parameters without runtime and batch size."""
    return replace(trial, runtime="eager", batch_size=1)


def format_score(value: float | None) -> str:
    """A score for people: 4 significant digits (``0.9712``, ``0.95``), an integral value with its decimals
    shown (``1.000``, ``100.0``: a measured score, not a count), "–" for None."""
    if value is None:
        return "–"
    text = f"{value:.4g}"
    if text.lstrip("-").isdigit():
        text = format(value, "#.4g").rstrip(".")
    return text


def check_score_options(mf, cfg) -> None:
    """Refuse a ``score`` that cannot be called, before the model runs (it is first called on the FP32 model),
    and a score limit that nothing would apply: ``cfg.min_score`` given, or ``cfg.min_score_ratio`` set away
    from its default (0.99), while the model file (or the live module's ``score=``) gives no ``score``; without
    one the relative L2 limit (``max_error``) decides accuracy and the score limit would be ignored.

    Args:
        mf: the model file (``mf.score`` is the metric or None; ``mf.path.name`` names it in the message).
        cfg: the run's ``TuneConfig``.

    Raises:
        UsageError: a live module's ``score=`` is not callable (``tctune.optimize(model, inputs, score=5)``), or
            ``field`` ``"min_score"`` or ``"min_score_ratio"``, naming the missing ``score`` and the fix.
        ModelFileError: a model file's ``score`` (a ``ModelFile`` built in Python) is not callable.
    """
    score = getattr(mf, "score", None)
    live = mf.path.name.startswith("<")  # ModelFile.from_module: a live module, its metric passed as score=
    if score is not None and not callable(score):
        what = type(score).__name__
        what = f"{'an' if what[0] in 'aeiou' else 'a'} {what}"
        if live:
            raise UsageError(f"score={score!r:.40} is {what}, not a function: "
                             "tctune calls score(model) on each candidate to gate its accuracy\n"
                             "  fix: pass score=your_metric, a function score(model) -> float (higher is better), "
                             "or leave score out")
        raise ModelFileError(f"{mf.path.name}: score is {what}, not a "
                             "function\n  expected: def score(model: torch.nn.Module) -> float (higher is better)")
    if score is not None:
        return
    field = ("min_score" if cfg.min_score is not None
             else "min_score_ratio" if cfg.min_score_ratio != DEFAULT_MIN_SCORE_RATIO else None)
    if field is not None:
        add = ("pass score=your_metric (score(model) -> float, higher is better)" if live
               else "define def score(model) -> float (higher is better) in the model file")
        raise UsageError(f"{field} needs a score(model) metric, and {mf.path.name} gives none: without one the "
                         "relative L2 limit (--max-error) decides accuracy and the score limit would be ignored\n"
                         f"  fix: {add}, or leave {field} out", field=field)


def score_value(value: Any) -> float:
    """``value`` (what ``score(model)`` returned) as a float: a real number (``int``, ``float``, a numpy scalar) or a
    tensor of one element (any dtype but bool, any device). NaN/inf pass through (the caller decides).

    Raises:
        TypeError: anything else — ``None`` (a ``score`` without ``return``), a bool, a string, a tensor of several
            elements —, with a message ``returned <what>; it must be one number``.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.dtype != torch.bool:
            return float(value.detach().reshape(()).item())
        what = f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    elif isinstance(value, bool) or value is None or isinstance(value, (str, bytes)):
        what = repr(value) if not isinstance(value, (str, bytes)) else f"the {type(value).__name__} {value!r:.40}"
    elif isinstance(value, numbers.Real) and not str(getattr(value, "dtype", "")).startswith("bool"):
        return float(value)
    else:
        what = f"a {type(value).__name__}"
    raise TypeError(f"returned {what}; it must be one number")


class ScoreGate:
    """Calls ``score`` (cached per graph), and says whether a score is accurate enough.

    Args:
        score: the user's ``score(model) -> float``.
        min_score_ratio: see ``TuneConfig.min_score_ratio`` (in (0, 1]).
        min_score: see ``TuneConfig.min_score`` (replaces the ratio when given).
        where: the name used in error messages (the model file's name).

    Attributes:
        fp32: the FP32 model's score (None until :meth:`reference` ran).
        calls: calls of ``score`` made (cached results are not calls); seconds: their total wall time (s).
    """

    def __init__(self, score: Callable, min_score_ratio: float = 0.99, min_score: float | None = None,
                 where: str = "the model file"):
        self.fn, self.min_score_ratio, self.min_score, self.where = score, min_score_ratio, min_score, where
        self.fp32: float | None = None
        self.cache: dict[Hashable, float] = {}
        self.calls = 0
        self.seconds = 0.0

    def _call(self, module: Any, precision: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        with precision_mode(precision), torch.inference_mode():
            value = self.fn(module)
        dt = time.perf_counter() - t0
        self.calls += 1
        self.seconds += dt
        return value, dt

    def reference(self, model: torch.nn.Module) -> float:
        """The FP32 model's score (computed once).

        Raises:
            ModelFileError: ``score`` raised, or did not return a finite number, on the FP32 model.
        """
        if self.fp32 is None:
            try:
                value, _ = self._call(model, "fp32")
            except Exception as exc:  # the user's code
                raise ModelFileError(f"{self.where}: score(model) raised {type(exc).__name__} on the FP32 model: {exc}\n"
                                     "  expected: def score(model: torch.nn.Module) -> float (higher is better; move "
                                     "your data to the model's device)") from exc
            try:
                value = score_value(value)
            except TypeError as exc:
                raise ModelFileError(f"{self.where}: score(model) {exc} for the FP32 model\n"
                                     "  fix: return one number, e.g. float(accuracy); expected: def score(model: "
                                     "torch.nn.Module) -> float (higher is better)") from None
            if not math.isfinite(value):
                raise ModelFileError(f"{self.where}: score(model) returned {value} for the FP32 model; it must be a "
                                     "finite number (higher is better)")
            self.fp32 = value
        return self.fp32

    def score(self, key: Hashable, module: Any, precision: str, numerics: str | None = None) -> tuple[float, float]:
        """``(score, seconds this call took)`` of the candidate graph ``key`` (0.0 s when cached). ``precision``
        names the candidate in messages; ``score`` runs under ``precision_mode(numerics or precision)`` (training
        scores its trained FP32 weights under ``"fp32"``).

        Raises:
            CandidateRejected: ``score`` raised on the candidate (a runtime error of that candidate), or returned
                NaN/inf (an accuracy failure).
        """
        if key in self.cache:
            return self.cache[key], 0.0
        try:
            value, dt = self._call(module, numerics or precision)
        except Exception as exc:  # noqa: BLE001 - the candidate broke the user's metric
            raise CandidateRejected(f"score(model) raised on the {precision} candidate: {type(exc).__name__}: "
                                    f"{(str(exc).strip().splitlines() or [''])[0][:200]}",
                                    FailureKind.RUNTIME_ERROR) from exc
        try:
            value = score_value(value)
        except TypeError as exc:
            raise CandidateRejected(f"score(model) {exc} for the {precision} candidate",
                                    FailureKind.RUNTIME_ERROR) from None
        if not math.isfinite(value):
            raise CandidateRejected(f"score(model) of the {precision} candidate is {value}", FailureKind.ACCURACY)
        self.cache[key] = value
        return value, dt

    @property
    def limit(self) -> float:
        """The lowest feasible score (needs :meth:`reference` first)."""
        if self.min_score is not None:
            return self.min_score
        return self.fp32 - (1 - self.min_score_ratio) * abs(self.fp32)

    def shortfall(self, value: float) -> float:
        """How far ``value`` is below the FP32 score, relative to it: ``(fp32 - value) / |fp32|`` (absolute when
        the FP32 score is 0); negative when ``value`` is better. The FP8 planner minimizes this."""
        return (self.fp32 - value) / (abs(self.fp32) or 1.0)

    @property
    def allowed_shortfall(self) -> float:
        """:meth:`shortfall` of :attr:`limit` (0.01 by default)."""
        return self.shortfall(self.limit)

    def ratio(self, value: float) -> float | None:
        """``value / fp32``, or None when the FP32 score is 0."""
        return value / self.fp32 if self.fp32 else None

    def rule(self) -> str:
        """The gate in words, e.g. ``score >= 0.99 x 0.9722 (FP32) = 0.9625``."""
        if self.min_score is not None:
            return f"score >= {format_score(self.min_score)} (absolute)"
        return f"score >= {self.min_score_ratio:g} x {format_score(self.fp32)} (FP32) = {format_score(self.limit)}"

    def metrics(self, value: float, seconds: float) -> dict:
        """The trial attributes of a scored candidate: ``score``, ``score_ratio`` (to FP32), ``score_fp32``,
        ``score_limit`` and ``score_s`` (seconds this trial spent in ``score``; 0.0 when cached)."""
        return {"score": value, "score_ratio": self.ratio(value), "score_fp32": self.fp32, "score_limit": self.limit,
                "score_s": seconds}

    def to_dict(self) -> dict:
        """``report.json``'s ``score``: the FP32 score, the rule, the limit, calls and their cost."""
        return {"fp32": self.fp32, "min_score_ratio": self.min_score_ratio, "min_score": self.min_score,
                "limit": self.limit if self.fp32 is not None else None, "rule": self.rule() if self.fp32 is not None else None,
                "calls": self.calls, "seconds": self.seconds, "cached_graphs": len(self.cache)}


class CheckSet:
    """The seeded random rows every inference candidate's outputs are judged on, whatever batch size it is timed
    at: the reference inputs (:func:`tctune.trial.reference_inputs`) of every searched batch size, ``sum(batch_sizes)``
    rows (168 for the default 8, 32, 128). A candidate timed at batch ``b`` runs them ``b`` rows at a time
    (:meth:`chunks`), so it runs at no batch size but its own: a model that fails or hangs at another searched batch
    size is not run there. Its integer/bool outputs (class ids, masks) and its errors are then pooled over every
    row (:class:`tctune.measure.PooledComparison`), and the accuracy verdict no longer depends on which batch size
    was timed: before this, a bf16 graph whose class ids changed in 1 of 128 rows was rejected at batch 128 and
    accepted at batch 32, whose own 32 rows kept every id.

    Args:
        mf: the model file (``inputs``, ``batched_mask``); batch_sizes: the searched batch sizes; device: where
            the rows live.
        known: batch size -> ``(inputs, reference outputs)`` already made (the evaluator's references; the same
            seeded inputs, not made twice).
    """

    def __init__(self, mf, batch_sizes: Sequence[int], device: torch.device,
                 known: Mapping[int, tuple] | None = None):
        self.mf, self.device = mf, device
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.known = known if known is not None else {}
        self._inputs: dict[int, tuple] = {}

    @property
    def rows(self) -> int:
        """Rows judged: the sum of the searched batch sizes."""
        return sum(self.batch_sizes)

    def inputs(self, batch_size: int) -> tuple:
        """The seeded reference inputs of searched batch size ``batch_size`` (made once; not run)."""
        if batch_size in self.known:
            return self.known[batch_size][0]
        if batch_size not in self._inputs:
            self._inputs[batch_size] = reference_inputs(self.mf, batch_size, self.device)
        return self._inputs[batch_size]

    def chunks(self, batch_size: int) -> Iterator[tuple[tuple, int, int]]:
        """The rows as inputs of exactly ``batch_size`` rows each: ``(inputs, rows that count, source batch
        size)``. Each searched batch size's rows are cut in order; where fewer than ``batch_size`` are left (or
        the source is smaller), the chunk is filled by repeating that source's rows from its start, and only
        the first ``rows that count`` rows of the outputs count. Inputs that are not batched
        (``mf.batched_mask()``) are passed whole."""
        mask = self.mf.batched_mask()
        for source in self.batch_sizes:
            full = self.inputs(source)
            if source == batch_size:
                yield full, source, source
                continue
            for start in range(0, source, batch_size):
                count = min(batch_size, source - start)
                if count == batch_size:
                    chunk = tuple(t[start:start + batch_size] if m else t for t, m in zip(full, mask))
                else:
                    index = torch.arange(start, start + batch_size, device=self.device) % source
                    chunk = tuple(t.index_select(0, index.to(t.device)) if m else t for t, m in zip(full, mask))
                yield chunk, count, source


#: The element-wise worst of two comparisons of one candidate (:func:`tctune.measure.worst_stats`).
worst = worst_stats


__all__ = ["CheckSet", "ScoreGate", "format_score", "graph_key", "worst"]
