"""CPU checks of benchmarks/bench_autocast_policy.py: its A/B switch really changes the graph, and a row."""
from __future__ import annotations

import json
import sys

import torch

from benchload import load_benchmark

ab = load_benchmark("bench_autocast_policy")


def _cast_count(rule_on: bool) -> tuple[int, list[str]]:
    from passes import PassSpec, cast_precision

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.fc((x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True))

    ab._rule(rule_on)
    try:
        gm = torch.export.export(M().eval(), (torch.randn(2, 8),), strict=False).module()
        result = cast_precision(gm, PassSpec(precision="bf16"))
    finally:
        ab._rule(True)
    return result.count, [s.reason for s in result.skipped]


def test_the_switch_turns_the_rule_off_and_back_on():
    """``tctune_before`` must compile the earlier behaviour, or the A/B compares the code with itself."""
    cp = sys.modules["passes.cast_precision"]
    on_count, on_reasons = _cast_count(True)
    off_count, off_reasons = _cast_count(False)
    assert any(r.startswith("autocast:") for r in on_reasons)
    assert not any(r.startswith("autocast:") for r in off_reasons) and off_count > on_count
    assert cp._reads_fp32_value is cp._committed[0] and cp._feeds_low_compute is cp._committed[1]


def test_a_tiny_row_on_the_cpu(tmp_path):
    rc = ab.main(["--tiny", "--device", "cpu", "--models", "DistillGPT2", "--out", str(tmp_path), "--repeats", "1",
                  "--repeat-s", "0.001"])
    assert rc == 0
    row = json.loads((tmp_path / "DistillGPT2.json").read_text())
    assert "error" not in row, row
    assert set(row["variants"]) == {"autocast_inductor", "tctune_before", "tctune"}
    for name in ("tctune_before", "tctune"):
        assert row["variants"][name]["fallbacks"] == 0
        assert row["variants"][name]["rel_err"] < 5e-2
    assert "| DistillGPT2 |" in (tmp_path / "table.md").read_text()
