"""The plain baselines every study measures, and the side-by-side comparison that decides the headline.

Plain baselines are what a user would try by hand, at each searched batch size:

- ``fp32_eager``: the model as written in FP32 (the accuracy reference);
- ``autocast_<p>``: the model under ``torch.autocast`` at each low precision the hardware offers (fp16, bf16);
- ``cast_<p>``: the model cast as a whole (``model.half()`` / ``model.to(torch.bfloat16)``, :class:`CastModel`);
  its outputs, like every candidate's, follow ``TuneConfig.output_dtype`` (``"compute"``, the default: returned
  in the cast dtype as ``model.half()`` returns them; ``"fp32"``: cast to FP32 inside the timed call);
- on a GPU, ``compile_<name>``: ``torch.compile`` (mode ``default``, runtime ``inductor``) of the fastest of
  those at that batch size, as the PyTorch team's own benchmark compares against.

They are trials of the study marked with the user attribute ``baseline=<name>`` (and ``model_cast=True`` for
the cast ones, whose searched parameters equal their autocast twin's): enqueued before any searched trial, not
counted in ``--trials``, never stopped early, and re-timed after the search beside the finalists.

The side-by-side comparison (:func:`interleaved_speedup` on timings from
:func:`tctune.measure.time_interleaved`) times the finalists and the baselines in the same process, one block
of calls each per round (A B C A B C …, the order of PyTorch's ``benchmarks/dynamo/common.py``, which
interleaves "to handle frequency scaling and load changes"), and reports per-entry medians and, for a
speedup, a bootstrap 95 % confidence interval over rounds and a two-sided sign-test p-value.
"""
from __future__ import annotations

import copy
import math
import random
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_map

LOW_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

#: Rounds of the side-by-side comparison; each round times every entry once (a block of about
#: ``SIDE_BY_SIDE_BLOCK_S`` seconds of calls). 15 rounds give a sign test that can reach p < 0.001.
SIDE_BY_SIDE_ROUNDS = 15
SIDE_BY_SIDE_BLOCK_S = 0.05
#: Bootstrap resamples of the rounds for the speedup's confidence interval (seeded: the report is reproducible
#: from its timings).
BOOTSTRAP_SAMPLES = 2000


def _outputs_to(out: Any, dtype: torch.dtype, out_dtype: torch.dtype | None) -> Any:
    """``out`` with every tensor leaf of ``dtype`` cast to ``out_dtype`` (None: ``out`` unchanged)."""
    if out_dtype is None or out_dtype == dtype:
        return out
    return tree_map(lambda x: x.to(out_dtype) if isinstance(x, torch.Tensor) and x.dtype == dtype else x, out)


class CastModel(torch.nn.Module):
    """The model cast as a whole to ``dtype`` (``model.half()`` / ``model.to(torch.bfloat16)``).

    A deep copy of ``model`` with every floating parameter and buffer cast to ``dtype`` (the caller's model is
    untouched); floating tensor inputs are cast to ``dtype`` on the way in. Floating outputs of ``dtype`` are
    returned as the cast model returns them when ``out_dtype`` is None (the ``"compute"`` output contract of
    ``TuneConfig.output_dtype``: what a user running ``model.half()`` gets, no copy), or cast to ``out_dtype``
    inside the call (``torch.float32``: the ``"fp32"`` contract, the reference's dtype). Integer and bool inputs
    and outputs pass unchanged.

    Args:
        model: the FP32 model (copied).
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        out_dtype: the dtype floating outputs of ``dtype`` are returned in; None: left in ``dtype``.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, out_dtype: torch.dtype | None = torch.float32):
        super().__init__()
        self.model = copy.deepcopy(model).to(dtype)
        self.dtype, self.out_dtype = dtype, out_dtype

    def forward(self, *args, **kwargs):
        def down(x):
            return x.to(self.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        out = self.model(*tree_map(down, args), **tree_map(down, kwargs))
        return _outputs_to(out, self.dtype, self.out_dtype)


class OutputsTo(torch.nn.Module):
    """``module`` whose tensor outputs of ``dtype`` are cast to ``out_dtype`` inside the call: the autocast
    baseline under the ``"fp32"`` output contract (``TuneConfig.output_dtype``), where every candidate returns
    the FP32 model's dtypes and pays for the up-cast in its timing."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, out_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.module, self.dtype, self.out_dtype = module, dtype, out_dtype

    def forward(self, *args, **kwargs):
        return _outputs_to(self.module(*args, **kwargs), self.dtype, self.out_dtype)


@dataclass(frozen=True)
class Baseline:
    """One plain baseline at one batch size: ``name`` (e.g. ``autocast_bf16``), the trial ``params`` it is
    measured as (searched keys only) and whether it is the model cast as a whole."""

    name: str
    params: dict
    model_cast: bool = False

    def user_attrs(self) -> dict:
        """The user attributes its trial is enqueued with (``baseline``; ``model_cast`` when cast)."""
        return {"baseline": self.name, **({"model_cast": True} if self.model_cast else {})}


def plain_baselines(space, mode: str = "infer") -> list[Baseline]:
    """The eager plain baselines of search space ``space`` (a :class:`~tctune.search.space.SearchSpace`), batch
    size by batch size: FP32 eager, then autocast at each of fp16/bf16 in ``space.precisions``, then (inference
    only: pure low-precision training is not a plain recipe) the model cast as a whole at the same precisions."""
    out = []
    low = [p for p in ("fp16", "bf16") if p in space.precisions]
    for bs in space.batch_sizes:
        out.append(Baseline("fp32_eager", space.candidate(batch_size=bs, precision="fp32", graph_passes=False,
                                                           runtime="eager")))
        for p in low:
            out.append(Baseline(f"autocast_{p}", space.candidate(batch_size=bs, precision=p, graph_passes=False,
                                                                  runtime="eager")))
        if mode == "infer":
            for p in low:
                out.append(Baseline(f"cast_{p}", space.candidate(batch_size=bs, precision=p, graph_passes=False,
                                                                  runtime="eager"), model_cast=True))
    return out


#: Name prefix of the ``torch.compile(mode="reduce-overhead")`` baselines (Inductor + CUDA graphs).
REDUCE_OVERHEAD = "compile_ro_"


def compile_baseline(fastest: Baseline, cudagraphs: bool = False) -> Baseline:
    """``torch.compile`` of eager baseline ``fastest``: mode ``default`` (runtime ``inductor``, named
    ``compile_<name>``) or, with ``cudagraphs``, mode ``reduce-overhead`` (runtime ``inductor-cudagraphs``: Inductor
    plus CUDA graphs, named ``compile_ro_<name>``), what a user tries next when a small model is launch-bound."""
    if cudagraphs:
        return Baseline(f"{REDUCE_OVERHEAD}{fastest.name}", dict(fastest.params, runtime="inductor-cudagraphs"),
                        fastest.model_cast)
    return Baseline(f"compile_{fastest.name}", dict(fastest.params, runtime="inductor"), fastest.model_cast)


_LABELS = {"fp32_eager": "FP32 eager", "autocast_fp16": "autocast fp16 eager", "autocast_bf16": "autocast bf16 eager",
           "cast_fp16": "model.half() eager", "cast_bf16": "model.to(torch.bfloat16) eager"}


#: Which plain baseline is preferred when two measure the same throughput (an exact tie; timings are floats,
#: so this is rare but must not depend on trial order): the simplest and numerically safest first. FP32 eager
#: changes nothing; autocast keeps FP32 weights and PyTorch's FP32 op list; the model cast as a whole puts every
#: op in low precision; ``torch.compile`` adds a compile step. A searched (tctune) candidate ranks after every
#: baseline: at equal speed, the plain recipe is the answer. Then the smaller batch size (lower latency per call).
BASELINE_PREFERENCE = ("fp32_eager", "autocast_", "cast_", "compile_")


def baseline_rank(name: str | None) -> int:
    """The place of baseline ``name`` in :data:`BASELINE_PREFERENCE` (0 = preferred); a searched candidate
    (``name`` None) or an unknown name ranks after every baseline."""
    for i, prefix in enumerate(BASELINE_PREFERENCE):
        if name and name.startswith(prefix):
            return i
    return len(BASELINE_PREFERENCE)


def preference(throughput: float, name: str | None, batch_size: int, number: int) -> tuple:
    """Sort key, best first, for trials compared by ``throughput`` (items/s): faster first; at equal throughput
    the preferred baseline (:func:`baseline_rank`), then the smaller batch size, then the earlier trial."""
    return (-throughput, baseline_rank(name), batch_size, number)


def baseline_label(name: str) -> str:
    """What a user calls baseline ``name``: ``"model.half() eager"`` for ``cast_fp16``, ``"torch.compile(autocast
    bf16)"`` for ``compile_autocast_bf16``; an unknown name is returned as is."""
    if name.startswith(REDUCE_OVERHEAD):
        inner = _LABELS.get(name[len(REDUCE_OVERHEAD):], name[len(REDUCE_OVERHEAD):])
        return f"torch.compile({inner.removesuffix(' eager')}, mode='reduce-overhead')"
    if name.startswith("compile_"):
        inner = _LABELS.get(name[len("compile_"):], name[len("compile_"):])
        return f"torch.compile({inner.removesuffix(' eager')})"
    return _LABELS.get(name, name)


def run_params(params: dict, user_attrs: dict) -> dict:
    """A trial's searched ``params`` as the trial ran them: with ``runtime`` replaced by the trial's ``runtime``
    user attribute when it has one. The max-autotune finalist (:mod:`tctune.search.autotune`) records its
    runtime there: its Optuna parameters are those of the candidate it rebuilt (a runtime outside the searched
    choices cannot be an Optuna parameter of the study), so what reads a trial to rebuild, report or export it
    reads this, never ``params`` alone."""
    out = dict(params)
    if user_attrs.get("runtime"):
        out["runtime"] = user_attrs["runtime"]
    return out


def candidate_params(params: dict, user_attrs: dict) -> dict:
    """The parameters that identify a trial's candidate: its :func:`run_params` plus ``model_cast: True`` for
    the model cast as a whole (whose searched parameters equal its autocast twin's)."""
    out = run_params(params, user_attrs)
    if user_attrs.get("model_cast"):
        out["model_cast"] = True
    return out


def _median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    return statistics.median(a) / statistics.median(b)


def interleaved_speedup(base_ms: Sequence[float], best_ms: Sequence[float], seed: int = 0,
                        samples: int = BOOTSTRAP_SAMPLES) -> dict:
    """The speedup of a candidate over a baseline from paired per-round timings of the same batch size.

    Args:
        base_ms, best_ms: ms per call of the baseline and of the candidate, one value per round (same length,
            round ``i`` of each timed back to back).
        seed: bootstrap seed.
        samples: bootstrap resamples.

    Returns:
        ``{"speedup": median(base) / median(best), "ci95": [lo, hi]`` (percentile bootstrap over rounds,
        resampled in pairs), ``"p_value"`` (two-sided exact sign test on the rounds where one was faster; None
        with fewer than 2 such rounds), ``"rounds"``, ``"rounds_faster"`` (rounds where the candidate was
        faster)}.

    Raises:
        ValueError: the lists differ in length or are empty.
    """
    if len(base_ms) != len(best_ms) or not base_ms:
        raise ValueError(f"paired timings needed: {len(base_ms)} baseline rounds, {len(best_ms)} candidate rounds")
    n = len(base_ms)
    rng = random.Random(seed)
    boots = []
    for _ in range(samples):
        idx = [rng.randrange(n) for _ in range(n)]
        boots.append(_median_ratio([base_ms[i] for i in idx], [best_ms[i] for i in idx]))
    boots.sort()
    lo, hi = boots[int(0.025 * (samples - 1))], boots[int(math.ceil(0.975 * (samples - 1)))]
    faster = sum(b < a for a, b in zip(base_ms, best_ms))
    slower = sum(b > a for a, b in zip(base_ms, best_ms))
    m = faster + slower
    p = None
    if m >= 2:
        k = min(faster, slower)
        p = min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2 ** m)
    return {"speedup": _median_ratio(base_ms, best_ms), "ci95": [lo, hi], "p_value": p, "rounds": n,
            "rounds_faster": faster}


# -- GPU clocks during timing (NVML) ------------------------------------------------------------------------
_THROTTLE_NAMES = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


class ClockMonitor:
    """Samples the GPU's SM clock (MHz) and clock throttle reasons through NVML (the ``nvidia-ml-py`` package,
    imported as ``pynvml``) while timing runs; every NVML call is guarded, so a machine without it records why.

    :meth:`sample` is called between rounds; :meth:`summary` returns ``{"available": True, "sm_clock_mhz":
    {"min", "max", "samples"}, "sm_clock_max_mhz", "throttle_reasons": [names seen, "gpu_idle" excluded]}`` or
    ``{"available": False, "reason": ...}`` (on the CPU: ``"not available (measured on the CPU)"``).
    """

    def __init__(self, device: torch.device):
        self.handle, self.nvml, self.reason = None, None, None
        self.clocks: list[int] = []
        self.reasons: set[str] = set()
        self.max_clock = None
        if device.type != "cuda":
            self.reason = "not available (measured on the CPU)"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            props = torch.cuda.get_device_properties(device)
            uuid = getattr(props, "uuid", None)
            try:
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}") if uuid else None
            except Exception:  # noqa: BLE001 - fall back to the index
                self.handle = None
            if self.handle is None:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self.max_clock = int(pynvml.nvmlDeviceGetMaxClockInfo(self.handle, pynvml.NVML_CLOCK_SM))
        except Exception as exc:  # noqa: BLE001 - no NVML: recorded, never raised
            self.handle = None
            self.reason = f"not available (NVML: {type(exc).__name__}: {str(exc)[:120]})"

    def sample(self) -> None:
        if self.handle is None:
            return
        try:
            nv = self.nvml
            self.clocks.append(int(nv.nvmlDeviceGetClockInfo(self.handle, nv.NVML_CLOCK_SM)))
            get = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
            mask = int(get(self.handle))
            self.reasons |= {name for bit, name in _THROTTLE_NAMES.items() if mask & bit and name != "gpu_idle"}
        except Exception as exc:  # noqa: BLE001
            self.reason = f"NVML sampling failed: {type(exc).__name__}: {str(exc)[:120]}"

    def summary(self) -> dict[str, Any]:
        if self.handle is None or not self.clocks:
            return {"available": False, "reason": self.reason or "no samples"}
        return {"available": True, "sm_clock_mhz": {"min": min(self.clocks), "max": max(self.clocks),
                                                     "samples": len(self.clocks)},
                "sm_clock_max_mhz": self.max_clock, "throttle_reasons": sorted(self.reasons)}


__all__ = ["BASELINE_PREFERENCE", "BOOTSTRAP_SAMPLES", "Baseline", "CastModel", "ClockMonitor", "OutputsTo",
           "REDUCE_OVERHEAD", "SIDE_BY_SIDE_BLOCK_S", "baseline_label", "baseline_rank", "preference",
           "SIDE_BY_SIDE_ROUNDS", "candidate_params", "compile_baseline", "interleaved_speedup", "plain_baselines",
           "run_params"]
