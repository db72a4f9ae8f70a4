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


def test_a_stalled_calibration_call_does_not_shrink_the_repeats():
    """The repeat size comes from the fastest of a few single calls: one call held up by the host (here the first
    one after warm-up sleeps 20 ms, every other call is ~free) must not turn repeats into a handful of calls."""
    import time as _time

    from tctune.measure import _iterations_for

    calls = {"n": 0}

    def fn():
        calls["n"] += 1
        if calls["n"] == 2:  # the first call after the one warm-up call
            _time.sleep(0.02)

    iters = _iterations_for(fn, torch.device("cpu"), warmup=1, target_s=0.01, max_iterations=200)
    assert iters == 200  # sized on a ~microsecond call, not on the 20 ms stall (which would give 1)
