"""Tests for passes.calibrate (overflow analysis) and cast_precision's use of PassSpec.fp32_nodes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import zoo
from passes import PassSpec, cast_precision
from passes.calibrate import MAX_ABS_META, NONFINITE_META, calibrate_ranges, ignored_reasons, overflow_nodes

FP16 = PassSpec(precision="fp16")


def _calibrated(name="overflow_mlp", precision="fp16"):
    model, gm, entry = zoo.build(name)
    torch.manual_seed(11)
    ranges = calibrate_ranges(gm, [entry.example_inputs(8) for _ in range(3)])
    return model, gm, entry, ranges


def test_calibrate_ranges_records_max_abs():
    model, gm, entry = zoo.build("mlp")
    torch.manual_seed(3)
    batches = [entry.example_inputs(4) for _ in range(2)]

    ranges = calibrate_ranges(gm, batches)

    with torch.no_grad():
        peak = max(model(*b).abs().max().item() for b in batches)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert ranges[out.name] == pytest.approx(peak)
    assert out.meta[MAX_ABS_META] == ranges[out.name]
    assert all(v >= 0 for v in ranges.values())


def test_overflow_nodes_limits():
    ranges = {"a": 7.1e4, "b": 3.0e4, "c": 40000.0, "d": float("nan"), "e": float("inf")}

    # NaN / inf statistics are not overflow (the FP32 run produced them; the low dtype holds inf too).
    assert overflow_nodes(ranges, "fp16") == {"a", "c"}  # > 65504 / 2
    assert overflow_nodes(ranges, "fp16", margin=1.0) == {"a"}
    assert overflow_nodes(ranges, "bf16") == frozenset()
    assert overflow_nodes(ranges, "tf32") == frozenset()
    reasons = ignored_reasons(ranges)
    assert reasons["d"] == "calibration: FP32 run gave NaN here; ignored for overflow"
    assert reasons["e"].startswith("calibration: FP32 run gave +-inf here") and set(reasons) == {"d", "e"}
    with pytest.raises(ValueError, match="margin"):
        overflow_nodes(ranges, "fp16", margin=0)


def test_cast_precision_without_calibration_overflows():
    model, gm, entry = zoo.build("overflow_mlp")

    cast_precision(gm, FP16)

    with torch.no_grad():
        out = gm(*entry.example_inputs(6))
    assert not torch.isfinite(out).all()


def test_cast_precision_keeps_overflow_nodes_fp32():
    model, gm, entry, ranges = _calibrated()
    fp32 = overflow_nodes(ranges, "fp16")
    assert fp32 >= {"linear", "gelu"}

    result = cast_precision(gm, dataclasses.replace(FP16, fp32_nodes=fp32))

    reasons = {s.node: s.reason for s in result.skipped}
    assert reasons["linear"].startswith("overflow: max |x| 2.")
    assert reasons["linear"].endswith("> 65504/2 at fp16 (module big)")
    assert reasons["linear_1"] == "overflow: reads gelu, out of fp16 range (module small)"
    assert gm.big.weight.dtype == torch.float32
    zoo.assert_matches_eager(model, gm, entry.example_inputs(6), "fp16")  # finite and accurate


def test_cast_precision_overflow_idempotent():
    model, gm, entry, ranges = _calibrated()
    spec = dataclasses.replace(FP16, fp32_nodes=overflow_nodes(ranges, "fp16"))
    cast_precision(gm, spec)
    code = gm.code

    again = cast_precision(gm, spec)

    assert again.notes["casts_inserted"] == 0 and gm.code == code


def test_cast_precision_skips_overflow_rule_at_bf16():
    model, gm, entry, ranges = _calibrated()
    spec = PassSpec(precision="bf16", fp32_nodes=overflow_nodes(ranges, "bf16"))
    keys = list(gm.state_dict())

    result = cast_precision(gm, spec)

    assert spec.fp32_nodes == frozenset() and result.count > 0
    assert not any(s.reason.startswith("overflow") for s in result.skipped)
    assert list(gm.state_dict()) == keys
    zoo.assert_matches_eager(model, gm, entry.example_inputs(6), "bf16")


def test_cast_precision_overflow_names_bert_module():
    model, gm, entry = zoo.build("bert")
    dense = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default and "output.dense" in str(
        n.meta.get("nn_module_stack")))
    dense.meta[MAX_ABS_META] = 7.1e4

    result = cast_precision(gm, PassSpec(precision="fp16", fp32_nodes=frozenset({dense.name})))

    reasons = {s.node: s.reason for s in result.skipped}
    assert reasons[dense.name] == "overflow: max |x| 7.1e4 > 65504/2 at fp16 (module encoder.layer.0.attention.output.dense)"
    zoo.assert_matches_eager(model, gm, entry.example_inputs(2), "fp16")


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_out_of_range_check_matches_the_elementwise_definition(low, dtype):
    """The weight range check (one aminmax, an element-wise pass only when an end is non-finite or beyond the
    range) answers as "some finite |x| exceeds finfo(low).max" on every mix of inf, NaN, big and normal values."""
    from passes.cast_precision import _has_out_of_range

    def reference(t):
        mag = t.abs()
        return bool(((mag > torch.finfo(low).max) & torch.isfinite(mag)).any())

    inf, nan = float("inf"), float("nan")
    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(257, generator=g), torch.randn(16, 16, generator=g) * 1e5, [7e4, 2.0], [-7e4, 2.0],
             [inf, 1.0], [inf, 7e4], [nan, 1.0], [nan, -7e4], [-inf, inf], [-inf, -7e4, 3.0], [nan], [65504.0],
             [65520.0], [3.39e38, 3.4e38], [3.4e38, inf], [[nan, inf], [1e6, 0.0]]]
    for case in cases:
        t = (case if isinstance(case, torch.Tensor) else torch.tensor(case)).to(dtype)
        assert _has_out_of_range(t, low) == reference(t), (case, low, dtype)
    assert _has_out_of_range(torch.empty(0, dtype=dtype), low) is False
    big = torch.randn(64, generator=g, dtype=dtype)
    big[5] = 1e5
    assert _has_out_of_range(big, low) == (low == torch.float16)
