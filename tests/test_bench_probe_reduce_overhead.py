"""benchmarks/probe_reduce_overhead.py on the CPU at --tiny (default mode there: no CUDA graphs): each variant
compiles its own graph and computes what the dt model computes, and ``tctune_nonstatic`` hands Inductor the
backend's graph without the Dynamo mark that makes its frozen weights static inputs (``tctune`` with it).
Inductor (``compile_fx``) is replaced by running the graph it is handed."""
from __future__ import annotations

import pytest
import torch

from zoo import inductor_runs_the_graph, load_benchmark


def test_the_nonstatic_variant_hands_inductor_the_graph_without_the_static_mark(monkeypatch):
    pytest.importorskip("transformers")
    import tctune.backend as tb

    probe = load_benchmark("probe_reduce_overhead")
    handed = inductor_runs_the_graph(monkeypatch)
    torch._dynamo.reset()
    row = probe.measure("BertForMaskedLM", "bf16", repeats=1, scale=0.0625, device="cpu", tiny=True)
    torch._dynamo.reset()
    assert set(row["ms"]) == {"inductor", "tctune", "tctune_nonstatic"}
    assert len(handed) == 3  # no variant reused another's compile
    errs = row["rel_err_vs_dt_eager"]
    assert all(e is not None and e < 1e-2 for e in errs.values()), errs
    inductor_gm, static_gm, nonstatic_gm = handed
    assert "dynamo_compile_id" in static_gm.meta and "dynamo_compile_id" not in nonstatic_gm.meta
    assert any(n.op == "get_attr" for n in nonstatic_gm.graph.nodes)  # the backend's graph, weights frozen
    assert tb._weights_static is not None and tb._weights_static.__name__ == "_weights_static"  # restored
    assert row["mode"] is None and row["speedup_vs_inductor"]["inductor"] == 1.0
