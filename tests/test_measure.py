"""tctune.measure.compare: the error of a candidate against the FP32 reference, chunked on the device."""
from __future__ import annotations

import math

import pytest
import torch

import tctune.measure as measure
from tctune.errors import CandidateRejected


def _naive(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    o, r = out.double(), ref.double()
    d = o - r
    return float(d.abs().max()), float(d.norm() / r.norm())


@pytest.mark.parametrize("chunk", [1 << 25, 7])  # one chunk, and many uneven chunks
def test_compare_matches_float64_reference(monkeypatch, chunk):
    monkeypatch.setattr(measure, "ERROR_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    ref = {"a": torch.randn(5, 11, generator=g), "b": torch.randn(3, 4, 2, generator=g)}
    out = {"a": ref["a"].half().float(), "b": ref["b"] + 1e-2 * torch.randn(3, 4, 2, generator=g)}

    err = measure.compare(out, ref)

    want = [_naive(out[k], ref[k]) for k in ("a", "b")]
    assert err.nonfinite == 0
    assert math.isclose(err.max_abs_error, max(w[0] for w in want), rel_tol=1e-12)
    assert math.isclose(err.rel_l2_error, max(w[1] for w in want), rel_tol=1e-9)


def test_compare_counts_nonfinite_and_ignores_them_in_the_norm(monkeypatch):
    monkeypatch.setattr(measure, "ERROR_CHUNK", 4)
    ref = torch.randn(10, generator=torch.Generator().manual_seed(1))
    out = ref.clone()
    out[3], out[8] = float("nan"), float("inf")

    err = measure.compare(out, ref)

    assert err.nonfinite == 2
    # the two bad entries count as 0 in the difference: exactly |ref| there
    expected = float(torch.stack([ref[3], ref[8]]).double().norm() / ref.double().norm())
    assert math.isclose(err.rel_l2_error, expected, rel_tol=1e-9)


def test_compare_rejects_structure_changes():
    with pytest.raises(CandidateRejected, match="output shape"):
        measure.compare(torch.zeros(2, 3) + 1, torch.ones(3, 2))
    with pytest.raises(CandidateRejected, match="floating outputs"):
        measure.compare((torch.ones(2),), (torch.ones(2), torch.ones(2)))


class FakeClock:
    """A stand-in for the ``time`` module measure reads: ``perf_counter`` is a clock that only the timed function
    advances, so a test's timings are what it says, whatever the host's load (a real 1 µs call can take 100 µs
    when the host preempts it)."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def test_a_stalled_calibration_call_does_not_shrink_the_repeats(monkeypatch):
    """The repeat size comes from the fastest of a few single calls: one call held up by the host (here the first
    one after warm-up takes 20 ms, every other call 1 µs) must not turn repeats into a handful of calls."""
    from tctune.measure import CALIBRATION_CALLS, _iterations_for

    clock = FakeClock()
    monkeypatch.setattr(measure, "time", clock)
    calls = {"n": 0}

    def fn():
        calls["n"] += 1
        clock.now += 0.02 if calls["n"] == 2 else 1e-6  # the first call after the one warm-up call stalls

    iters = _iterations_for(fn, torch.device("cpu"), warmup=1, target_s=0.01, max_iterations=200)
    assert calls["n"] == 1 + CALIBRATION_CALLS
    assert iters == 200  # sized on the 1 µs call (10,000 calls, capped), not on the 20 ms stall (which would give 1)
    # the same stall on every calibration call: the repeat really is one call (the fastest is the stall)
    clock2 = FakeClock()
    monkeypatch.setattr(measure, "time", clock2)

    def stalled():
        clock2.now += 0.02

    assert _iterations_for(stalled, torch.device("cpu"), warmup=1, target_s=0.01, max_iterations=200) == 1
