"""benchmarks/probe_frozen_weights.py on the CPU at --tiny: every variant compiles the dt model's graph once, in its
own compile, and computes what the dt model computes; the frozen variants hand Inductor a graph whose weights are
constants and whose only input is the runtime tensor. Inductor (``compile_fx``) is replaced by running the graph
it is handed, so the static-input counts (Inductor's own bookkeeping) are not checked here."""
from __future__ import annotations

import pytest
import torch

from zoo import inductor_runs_the_graph, load_benchmark


def test_each_variant_runs_the_dt_models_graph_with_the_static_inputs_it_claims(monkeypatch):
    pytest.importorskip("transformers")
    probe = load_benchmark("probe_frozen_weights")
    handed = inductor_runs_the_graph(monkeypatch)
    torch._dynamo.reset()
    row = probe.measure("BertForMaskedLM", "bf16", repeats=1, scale=0.0625, device="cpu", tiny=True)
    torch._dynamo.reset()
    assert set(row["ms"]) == {"inductor", "fx_inputs", "fx_frozen", "fx_frozen_static", "tctune", "tctune_static"}
    assert len(handed) == 6  # each variant compiled its own graph: no variant reused another's cache entry
    errs = row["rel_err_vs_dt_eager"]
    assert all(e is not None and e < 1e-2 for e in errs.values()), errs  # the dt model's outputs, bf16 rounding
    frozen = [g for g in handed if any(n.op == "get_attr" for n in g.graph.nodes)]
    assert len(frozen) == 4  # fx_frozen, fx_frozen_static and both tctune variants read their weights as constants
    assert [sum(n.op == "placeholder" for n in g.graph.nodes) for g in frozen] == [1, 1, 1, 1]
    assert row["speedup_vs_inductor"]["inductor"] == 1.0 and row["device"] == "cpu"


def test_probe_main_writes_every_row_after_each_model_and_prints_the_shown_fields(tmp_path, capsys):
    import json

    probe = load_benchmark("probe_frozen_weights")
    calls = []

    def measure(name, dtype, repeats, scale, device, tiny):
        calls.append((name, dtype, repeats, scale, device, tiny))
        return {"name": name, "ms": {"inductor": 2.0}, "other": 1}

    rc = probe.probe_main(["--models", "a,b", "--device", "cpu", "--tiny", "--repeats", "2", "--out", str(tmp_path)],
                          "doc line\nmore", "x", measure, "rows.json", ("ms",), "help", reset=False)
    assert rc == 0 and calls == [("a", "bf16", 2, 1.0, "cpu", True), ("b", "bf16", 2, 1.0, "cpu", True)]
    assert [r["name"] for r in json.loads((tmp_path / "rows.json").read_text())] == ["a", "b"]
    assert capsys.readouterr().out.splitlines() == ['a {"inductor": 2.0}', 'b {"inductor": 2.0}']
