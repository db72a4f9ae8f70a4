"""``torch._dynamo.reset()`` leaves no stale ``tctune.backend.reports``: each tctune backend has the ``reset``
Dynamo calls on the backends of the ``torch.compile`` calls since its previous reset; ``tctune.backend.reset()``
clears them in every case."""
from __future__ import annotations

import pytest
import torch

import tctune.backend as tb
from zoo import fresh_backend as _fresh  # noqa: F401 - autouse: no compiled graph or report before each test


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()


@pytest.mark.parametrize("how", ["name", "callable", "function"])
def test_dynamo_reset_empties_the_reports(how):
    m, x = _model(), torch.randn(4, 8)
    compiler = {"name": "tctune", "callable": tb.backend(precision="fp32"), "function": tb.tctune_backend}[how]
    compiled = torch.compile(m, backend=compiler)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-6)  # (it compiled through tctune)
    assert len(tb.reports) == 1 and not tb.reports[0].fallback, tb.reports
    torch._dynamo.reset()
    assert tb.reports == [] and tb.last_results == []
    fresh = torch.compile(m, backend=compiler)  # compiling again after the reset: one report, the new one
    with torch.no_grad():
        fresh(torch.randn(4, 8))
    assert len(tb.reports) == 1


def test_backend_reset_empties_the_reports_of_a_module_compiled_before_an_earlier_dynamo_reset():
    m = _model()
    compiled = torch.compile(m, backend="tctune", options={"precision": "fp32"})
    with torch.no_grad():
        compiled(torch.randn(4, 8))
        torch._dynamo.reset()
        compiled(torch.randn(4, 8))  # the same compiled module compiles again
    assert len(tb.reports) == 1
    tb.reset()
    assert tb.reports == [] and tb.last_results == []
