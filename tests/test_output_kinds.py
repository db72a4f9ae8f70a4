"""tctune.measure.compare by output kind: integer/bool outputs exactly, logits-like outputs with top-1 and
KL, non-tensor outputs compared or counted as not checkable, the FP64 rule, and how the report shows them."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import tctune.measure as measure
from tctune.errors import CandidateRejected
from tctune.measure import ErrorStats, check_accuracy, compare


class NearTiedClassifier(nn.Module):
    """Logits over 16 classes whose weight columns differ by 1e-3 of their size: bf16's rounding (relative
    2^-9 ≈ 2e-3) reorders near-tied classes. Returns the logits and the class ids (argmax)."""

    def __init__(self, d: int = 64, classes: int = 16, ids_only: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        common = torch.randn(d, 1, generator=g)
        self.w = nn.Parameter(common + 1e-3 * torch.randn(d, classes, generator=g))
        self.ids_only = ids_only

    def forward(self, x):
        logits = x @ self.w
        ids = logits.argmax(-1)
        return ids if self.ids_only else {"logits": logits, "ids": ids}


def _inputs(batch: int = 256, d: int = 64, seed: int = 11) -> torch.Tensor:
    return torch.randn(batch, d, generator=torch.Generator().manual_seed(seed))


def _bf16_run(model: nn.Module, x: torch.Tensor):
    with torch.inference_mode():
        return torch.utils._pytree.tree_map(
            lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
            model.to(torch.bfloat16)(x.bfloat16()))


def test_class_ids_that_flip_at_bf16_are_a_mismatch_and_rejected():
    x = _inputs()
    model = NearTiedClassifier(ids_only=True)
    with torch.inference_mode():
        ref = model(x)
    out = _bf16_run(model, x)
    flipped = float((out != ref).double().mean())
    assert flipped > 0.05  # the premise: bf16 changes many ids of near-tied logits

    err = compare(out, ref)

    assert err.float_outputs == 0 and err.exact_outputs == 1
    assert math.isclose(err.mismatch_rate, flipped, rel_tol=1e-12)
    assert err.mismatched == int((out != ref).sum())
    with pytest.raises(CandidateRejected, match=r"integer/bool outputs differ from FP32 in .*% of their elements"):
        check_accuracy(err, "bf16", out)
    # the user may allow a rate: just above it passes, just below it fails
    check_accuracy(err, "bf16", out, max_mismatch_rate=flipped)
    with pytest.raises(CandidateRejected):
        check_accuracy(err, "bf16", out, max_mismatch_rate=flipped * 0.99)
    assert err.to_metrics()["mismatch_rate"] == err.mismatch_rate


def test_logits_within_the_l2_limit_do_not_hide_flipped_ids():
    x = _inputs()
    model = NearTiedClassifier()
    with torch.inference_mode():
        ref = model(x)
    out = _bf16_run(model, x)

    err = compare(out, ref)

    assert err.rel_l2_error < 1e-2  # the float check alone would accept this candidate
    assert err.float_outputs == 1 and err.exact_outputs == 1 and err.mismatch_rate > 0.05
    # the logits' own argmax flips exactly as often as the returned ids do
    assert math.isclose(err.top1_agreement, 1 - err.mismatch_rate, rel_tol=1e-12)
    with pytest.raises(CandidateRejected, match="integer/bool"):
        check_accuracy(err, "bf16", out)


def test_identical_integer_outputs_pass_and_int_dtypes_may_differ():
    ids = torch.randint(0, 1000, (4, 7), generator=torch.Generator().manual_seed(0))
    err = compare(ids.to(torch.int32), ids)  # e.g. a runtime that returns int32 for int64
    assert err.mismatch_rate == 0.0 and err.mismatched == 0 and err.exact_outputs == 1
    check_accuracy(err, "fp16", ids)
    with pytest.raises(CandidateRejected, match="1 floating outputs, the model 0"):
        compare(ids.float(), ids)
    x = torch.randn(4, 7)
    with pytest.raises(CandidateRejected, match="float32 output where the model returns torch.int64"):
        compare((ids.float(), x.long()), (ids, x))  # same counts, kinds swapped
    with pytest.raises(CandidateRejected, match="output shape"):
        compare(ids[:2], ids)


def test_bool_outputs_compared_exactly():
    g = torch.Generator().manual_seed(5)
    ref = torch.randn(10, 10, generator=g) > 0
    out = ref.clone()
    out[0, :3] = ~out[0, :3]  # 3 of 100 flipped

    err = compare({"mask": out}, {"mask": ref})

    assert err.exact_outputs == 1 and err.mismatched == 3 and math.isclose(err.mismatch_rate, 0.03)
    with pytest.raises(CandidateRejected, match=r"3\.00% of their elements \(3 elements\)"):
        check_accuracy(err, "fp16", out)
    check_accuracy(err, "fp16", out, max_mismatch_rate=0.05)


def test_mixed_dict_output_compares_each_kind():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 5, generator=g)
    ids = torch.arange(8)
    ref = {"logits": logits, "ids": ids, "n": 8, "label": "ok", "score": 2.0, "none": None}
    ids_out = ids.clone()
    ids_out[1] = 0  # 1 of 8 ids differ
    out = {"logits": logits + 1e-3, "ids": ids_out, "n": 8, "label": "ok", "score": 2.5, "none": None}

    err = compare(out, ref)

    # floats: the logits tensor and the Python float; relative error of the float is |2.5 - 2| / 2
    assert err.float_outputs == 2 and math.isclose(err.rel_l2_error, 0.25)
    assert math.isclose(err.max_abs_error, 0.5)
    # exact: ids (1/8 differ), n, label, none (all equal); the rate is the worst output's
    assert err.exact_outputs == 4 and err.mismatched == 1 and math.isclose(err.mismatch_rate, 1 / 8)
    assert err.unchecked_outputs == 0 and err.logits_outputs == 1 and err.top1_agreement == 1.0

    changed = dict(out, label="changed", ids=ids)
    e2 = compare(changed, ref)
    assert e2.mismatched == 1 and e2.mismatch_rate == 1.0  # a changed Python value is a whole-output mismatch


def test_python_scalars_of_different_kind_differ():
    err = compare((True, 1), (1, 1))  # True where the model returns the int 1
    assert err.mismatched == 1 and err.exact_outputs == 2


def test_non_tensor_outputs_that_cannot_be_compared_are_counted_not_zero_error():
    class Opaque:
        pass

    err = compare([Opaque(), Opaque()], [Opaque(), Opaque()])
    assert err.unchecked_outputs == 2 and err.float_outputs == 0 and err.exact_outputs == 0
    assert err.mismatch_rate is None and err.top1_agreement is None
    # a candidate that returns only the tensors: the model's non-tensor outputs cannot be checked
    t = torch.randn(3)
    err = compare((t,), (t, 3, "a"))
    assert err.unchecked_outputs == 2 and err.float_outputs == 1 and err.rel_l2_error == 0.0


def test_report_does_not_show_zero_error_without_floating_outputs():
    from tctune.report import accuracy_summary, _rel_error

    ids = torch.arange(10)
    row = compare((ids, object()), (ids, object())).to_metrics()
    assert _rel_error(row) == "–"
    line = accuracy_summary(row)
    assert "no floating outputs" in line and "1 output(s) not checkable" in line
    assert "0.00% of elements differ" in line
    assert _rel_error(compare(torch.ones(2) * 1.01, torch.ones(2)).to_metrics()) == "1.00e-02"


def test_top1_and_kl_on_a_known_pair():
    ref = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    out = torch.tensor([[0.0, 2.0, 0.0], [0.0, 1.0, 0.0]])

    err = compare(out, ref)

    p = [math.exp(v) for v in (2.0, 0.0, 0.0)]
    p = [v / sum(p) for v in p]
    q = [p[1], p[0], p[2]]  # the same distribution with classes 0 and 1 swapped
    kl_row0 = sum(a * math.log(a / b) for a, b in zip(p, q))
    assert err.logits_outputs == 1 and err.top1_agreement == 0.5
    assert math.isclose(err.kl_divergence, kl_row0 / 2, rel_tol=1e-12)  # row 1 is identical: KL 0


@pytest.mark.parametrize("chunk", [1 << 25, 5])
def test_logit_metrics_are_the_same_in_chunks(monkeypatch, chunk):
    monkeypatch.setattr(measure, "ERROR_CHUNK", chunk)
    g = torch.Generator().manual_seed(2)
    ref = torch.randn(4, 3, 7, generator=g)
    out = ref + 0.5 * torch.randn(4, 3, 7, generator=g)
    err = compare(out, ref)
    lr, lo = ref.double().log_softmax(-1), out.double().log_softmax(-1)
    want_kl = float((lr.exp() * (lr - lo)).sum(-1).mean())
    want_top = float((ref.argmax(-1) == out.argmax(-1)).double().mean())
    assert math.isclose(err.kl_divergence, want_kl, rel_tol=1e-9) and err.top1_agreement == want_top
    assert 0 < want_top < 1


def test_masked_logits_with_minus_inf_match_and_a_nan_there_does_not():
    ref = torch.tensor([[1.0, -math.inf, 0.5], [0.2, 0.1, -math.inf]])
    err = compare(ref.clone(), ref)
    assert err.nonfinite == 0 and err.rel_l2_error == 0.0 and err.kl_divergence == 0.0 and err.top1_agreement == 1.0
    bad = ref.clone()
    bad[0, 1] = float("nan")
    err = compare(bad, ref)
    assert err.nonfinite == 1 and err.top1_agreement == 0.5
    with pytest.raises(CandidateRejected, match="1 NaN/inf"):
        check_accuracy(err, "fp16", bad)


def test_model_output_and_dataclass_outputs_are_opened():
    from transformers.modeling_outputs import SequenceClassifierOutput

    @dataclasses.dataclass
    class Out:
        ids: torch.Tensor
        extra: dict

    logits = torch.randn(3, 4, generator=torch.Generator().manual_seed(9))
    ref = (SequenceClassifierOutput(logits=logits), Out(ids=torch.tensor([1, 2, 3]), extra={"k": 1}))
    out = (SequenceClassifierOutput(logits=logits * 1.5), Out(ids=torch.tensor([1, 2, 0]), extra={"k": 1}))

    err = compare(out, ref)

    assert err.float_outputs == 1 and math.isclose(err.rel_l2_error, 0.5, rel_tol=1e-6)
    assert err.exact_outputs == 2 and err.mismatched == 1 and math.isclose(err.mismatch_rate, 1 / 3)
    assert measure.float_leaves(out)[0] is out[0].logits


def test_fp64_ratio_is_the_rmse_ratio_with_its_floor():
    g = torch.Generator().manual_seed(4)
    ref64 = torch.randn(50, 20, generator=g, dtype=torch.float64)
    d = 1e-3 * torch.randn(50, 20, generator=g, dtype=torch.float64)
    base, out = (ref64 + d).float(), (ref64 + 2.5 * d).float()

    err = compare(out, base, ref64)

    def rmse(a):
        return float((a.double() - ref64).pow(2).mean().sqrt())
    want = rmse(out) / (rmse(base) + measure.FP64_FLOOR * float(ref64.pow(2).mean().sqrt()))
    assert math.isclose(err.fp64_ratio, want, rel_tol=1e-9) and 2.4 < err.fp64_ratio < 2.5
    check_accuracy(err, "bf16", out, fp64_gate=True)  # 2.5 ≤ 3 at bf16
    with pytest.raises(CandidateRejected, match="against FP64 is 2.4.x the baseline's"):
        check_accuracy(err, "fp32", out, fp64_gate=True)  # > 2 at fp32
    check_accuracy(err, "fp32", out)  # the rule is off unless asked for
    allowed = measure.scaled_tolerance(rmse(base), float(ref64.pow(2).mean().sqrt()), "bf16")
    assert rmse(out) <= allowed and rmse(out) > measure.scaled_tolerance(rmse(base), float(ref64.pow(2).mean().sqrt()), "fp32")
    assert compare(out, base).fp64_ratio is None
    with pytest.raises(ValueError, match="FP64 reference has 2 floating outputs"):
        compare(out, base, (ref64, ref64))


def test_fp64_rule_scales_with_the_baseline_at_the_candidates_precision():
    """A bf16 candidate is within 3x of the model run as written in bf16, but hundreds of times FP32's own
    error: the baseline of the rule must be at the candidate's precision."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 32))
    x = _inputs()
    with torch.inference_mode():
        ref = model(x)
    ref64 = measure.fp64_reference(model, (x,))
    assert ref64.dtype == torch.float64 and next(model.parameters()).dtype == torch.float32  # model untouched
    bf16_eager = _bf16_run(model, x)
    # the candidate: the same bf16 model, with one more rounding of its output (a different kernel's order)
    cand = bf16_eager.bfloat16().float() + (bf16_eager - ref) * 0.5

    vs_bf16 = compare(cand, ref, ref64, base=bf16_eager)
    vs_fp32 = compare(cand, ref, ref64)

    assert vs_bf16.fp64_ratio <= measure.fp64_multiplier("bf16")
    check_accuracy(vs_bf16, "bf16", cand, fp64_gate=True)
    assert vs_fp32.fp64_ratio > 100
    with pytest.raises(CandidateRejected, match="FP64 rule limit 3x"):
        check_accuracy(vs_fp32, "bf16", cand, fp64_gate=True)


def test_error_stats_built_by_hand_keep_their_meaning():
    err = ErrorStats(0.0, 0.0, 2)
    assert err.float_outputs is None and err.mismatch_rate is None
    m = err.to_metrics()
    assert m["max_rel_error"] == 0.0 and m["nonfinite"] == 2 and "rel_l2_error" not in m


def test_trial_fields_cover_error_stats_metrics():
    from tctune.report import TRIAL_FIELDS

    assert set(compare(torch.ones(2), torch.ones(2)).to_metrics()) <= set(TRIAL_FIELDS)


def test_report_lines_for_the_new_fields():
    from tctune.report import accuracy_summary

    row = {"float_outputs": 1, "max_rel_error": 1e-3, "mismatch_rate": 0.25, "mismatched": 4, "exact_outputs": 1,
           "top1_agreement": 0.75, "kl_divergence": 1.5e-3, "unchecked_outputs": 0, "fp64_ratio": 1.7}
    line = accuracy_summary(row)
    assert "25.00% of elements differ (4 elements) over 1 exact output(s)" in line
    assert "top-1 agreement 75.00%, KL(FP32 ‖ candidate) 1.50e-03 nats" in line
    assert "error against FP64 1.7x the baseline's" in line
    assert accuracy_summary({"float_outputs": 1, "max_rel_error": 1e-3}) is None
    assert "0.83% of elements differ (1 element) over" in accuracy_summary({**row, "mismatch_rate": 1 / 120,
                                                                             "mismatched": 1})


CLASS_IDS = '''
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w = torch.nn.Parameter(torch.randn(64, 1, generator=g) + 1e-3 * torch.randn(64, 16, generator=g))
    def forward(self, x):
        return (x @ self.w).argmax(-1)
def build_model():
    return M()
def example_inputs(batch_size):
    return (torch.randn(batch_size, 64),)
'''


def test_search_rejects_bf16_when_class_ids_flip(tmp_path):
    """End to end on the CPU: a model returning class ids of near-tied logits; the bf16 candidates change
    ids, so they are infeasible (with the reason), never reported as 0 error and feasible."""
    from tctune.hardware import resolve
    from tctune.modelfile import load_model_file
    from tctune.search import TuneConfig, Tuner, is_feasible

    f = tmp_path / "ids.py"
    f.write_text(CLASS_IDS)
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(256,), trials=8, quiet=True, export=False, prune=False)
    study = Tuner(cfg, load_model_file(f), resolve(None), device=torch.device("cpu")).run()
    by_precision: dict[str, list] = {}
    for t in study.trials:
        by_precision.setdefault(t.params["precision"], []).append(t)
    assert by_precision.get("bf16")
    for t in by_precision["bf16"]:
        assert not is_feasible(t)
        assert "integer/bool outputs differ from FP32" in t.user_attrs["fail_reason"]
    assert any(is_feasible(t) for t in by_precision["fp32"])  # the same ids: FP32 stays feasible


def test_complex_outputs_compare_both_parts():
    ref = torch.tensor([3 + 4j, 0 + 0j], dtype=torch.complex64)
    out = torch.tensor([3 + 4j, 0 + 1j], dtype=torch.complex64)
    err = compare(out, ref)
    assert err.float_outputs == 1 and math.isclose(err.rel_l2_error, 1 / 5) and err.max_abs_error == 1.0


def test_report_markdown_shows_the_kinds_per_trial_and_for_the_best():
    from tctune.report import TRIAL_FIELDS, render_markdown

    ids = torch.arange(6)
    logits = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    metrics = compare((torch.tensor([[0.0, 1.0], [0.0, 1.0]]), ids), (logits, ids)).to_metrics()
    row = {"number": 2, "state": "COMPLETE", "params": {"precision": "bf16", "batch_size": 8, "graph_passes": False},
           "throughput": 100.0, "latency_ms": 2.0, "fail_reason": None, **metrics}
    for k in TRIAL_FIELDS:
        row.setdefault(k, None)
    r = {"hardware": {}, "model": {"name": "m", "path": "m.py"}, "measured_on": "cpu",
         "study": {"name": "s", "n_trials": 1, "n_complete": 1}, "config": {"max_error": 0.01, "mode": "infer"},
         "capture": {"ok": True}, "best": row, "baseline": None, "passes": [], "trials": [row], "artifacts": {}}

    md = render_markdown(r)

    assert "integer and bool outputs must match exactly" in md
    assert "- Outputs against FP32: integer/bool outputs: 0.00% of elements differ over 1 exact output(s); " \
           "top-1 agreement 50.00%" in md
    assert "| 0.00% | 50.00% / " in md  # the trials table: int mismatch, then top-1 / KL
    r["config"]["max_mismatch_rate"] = 0.01
    assert "integer and bool outputs may differ in up to 1.00% of their elements" in render_markdown(r)
