"""torch._scaled_mm's fast accumulation as an FP8 option: the pass, TrialParams / best_config, the search's
choices and decision (tctune.fp8_plan.choose_fast_accum), the CLI flag, the report and the backend option."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import zoo
from passes import PassSpec
from passes.cast_fp8 import cast_fp8_linears
from passes.fp8_numerics import fp8_linear_reference
from passes.policy import pass_spec
from tctune.errors import UsageError
from tctune.fp8_plan import FAST_ACCUM_MIN_GAIN, METRIC_SCORE, FastAccumCheck, choose_fast_accum
from tctune.hardware import resolve
from tctune.modelfile import load_model_file
from tctune.search import InferenceEvaluator, TuneConfig, Tuner
from tctune.search.space import fp8_fast_accum_choices
from tctune.trial import TrialParams

_SCALED_MM = torch.ops.aten._scaled_mm.default


def _scaled_mms(gm) -> list:
    return [n for n in gm.graph.nodes if n.target == _SCALED_MM]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


# ----------------------------------------------------------------------------------------------- the pass


@pytest.mark.parametrize("fast", [False, True])
def test_pass_writes_use_fast_accum_from_the_spec_and_notes_it(fast):
    torch.manual_seed(0)
    gm = zoo.capture(MLP().eval(), (torch.randn(4, 64),))

    result = cast_fp8_linears(gm, PassSpec(precision="fp8", fp8_fast_accum=fast))

    mms = _scaled_mms(gm)
    assert result.count == 2 and len(mms) == 2
    assert [n.kwargs["use_fast_accum"] for n in mms] == [fast, fast]
    assert result.notes["fast_accum"] is fast


@zoo.SCALED_MM_ROW
def test_fast_accum_graph_parity_with_fp32_eager_and_the_reference_math_on_cpu():
    """The CPU's _scaled_mm accepts the flag; the graph stays within the FP8 SQNR floor of FP32 eager and equals
    the plain-torch reference up to bf16 rounding, on fresh random inputs at a batch size not seen at capture."""
    torch.manual_seed(1)
    model = MLP().eval()
    gm = zoo.capture(model, (torch.randn(4, 64),))
    cast_fp8_linears(gm, PassSpec(precision="fp8", fp8_fast_accum=True))
    single = zoo.capture(model.fc1, (torch.randn(4, 64),))
    cast_fp8_linears(single, PassSpec(precision="fp8", fp8_fast_accum=True))
    for seed in (30, 31):
        torch.manual_seed(seed)
        x = torch.randn(7, 64)
        with torch.no_grad():
            ref, got = model(x), gm(x)
            one = single(x)
        assert got.shape == ref.shape and torch.isfinite(got).all()
        assert zoo.rel_l2(got, ref) <= 10 ** (-25 / 20)  # 25 dB, the FP8 pass tests' floor
        torch.testing.assert_close(one, fp8_linear_reference(x, model.fc1.weight, model.fc1.bias).float(),
                                   rtol=1.6e-2, atol=1e-2)


def test_pass_spec_checks_and_normalises_fast_accum():
    with pytest.raises(ValueError, match="fp8_fast_accum must be True or False"):
        PassSpec(precision="fp8", fp8_fast_accum="yes")
    hw = resolve("h200")
    assert pass_spec(hw, "fp8", fp8_fast_accum=True).fp8_fast_accum is True
    assert pass_spec(hw, "bf16", fp8_fast_accum=True).fp8_fast_accum is False  # only meaningful at fp8
    assert pass_spec(hw, "fp8").fp8_fast_accum is False


# ------------------------------------------------------------------------------------ TrialParams, config


def test_trial_params_keep_fast_accum_only_at_fp8_and_round_trip():
    t = TrialParams(batch_size=8, precision="fp8", graph_passes=True, fp8_keep=("lm_head",), fp8_fast_accum=True)
    assert TrialParams.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    cfg = json.loads(json.dumps(t.to_config({"batch_size": 8, "precision": "fp8", "graph_passes": True})))
    assert cfg["fp8_fast_accum"] is True and TrialParams.from_config(cfg) == t
    assert "fp8_fast_accum=True" in repr(t)

    below = TrialParams(batch_size=8, precision="bf16", graph_passes=True, fp8_fast_accum=True)
    assert below.fp8_fast_accum is False and "fp8_fast_accum" not in repr(below)
    assert "fp8_fast_accum" not in below.to_config({"batch_size": 8, "precision": "bf16"})

    # a best_config.json written before the option existed measured full accumulation
    old = {"params": {"batch_size": 8, "precision": "fp8", "graph_passes": True}, "fp8_keep": ["lm_head"]}
    assert TrialParams.from_config(old).fp8_fast_accum is False
    assert TrialParams.from_dict({"batch_size": 8, "precision": "fp8"}).fp8_fast_accum is False
    with pytest.raises(UsageError, match="fp8_fast_accum must be true or false") as err:
        TrialParams.from_config({**old, "fp8_fast_accum": "on"})
    assert err.value.field == "fp8_fast_accum"


def test_tctune_export_reads_fast_accum_and_rejects_a_bad_value(tmp_path):
    from tctune.engines import read_config

    cfg = {"params": {"batch_size": 8, "precision": "fp8", "graph_passes": True}, "fp8_keep": [],
           "fp8_fast_accum": True}
    path = tmp_path / "best_config.json"
    path.write_text(json.dumps(cfg))
    assert TrialParams.from_config(read_config(path)).fp8_fast_accum is True
    path.write_text(json.dumps({**cfg, "fp8_fast_accum": "yes"}))
    with pytest.raises(UsageError, match="fp8_fast_accum must be true or false"):
        read_config(path)


def test_tune_config_field_checks_and_json_round_trip(tmp_path):
    cfg = TuneConfig(out_dir=str(tmp_path), fp8_fast_accum="off")
    assert TuneConfig.from_json(cfg.to_json()) == cfg
    assert TuneConfig(out_dir=str(tmp_path)).fp8_fast_accum == "auto"
    with pytest.raises(UsageError, match="fp8_fast_accum must be one of auto, on, off") as err:
        TuneConfig(out_dir=str(tmp_path), fp8_fast_accum="yes")
    assert err.value.field == "fp8_fast_accum"


def test_cli_flag_pins_fast_accum_and_is_in_help(tmp_path, capsys):
    from tctune.cli import main, parser
    from tctune.cli.optimize import config_from_args

    args = parser().parse_args(["optimize", "m.py", "--out", str(tmp_path), "--fp8-fast-accum", "off"])
    cfg = config_from_args(args)
    assert cfg.fp8_fast_accum == "off"
    assert fp8_fast_accum_choices(resolve("h200").search_precisions(True), "Hopper", cfg.fp8_fast_accum) == (False,)
    assert config_from_args(parser().parse_args(["optimize", "m.py"])).fp8_fast_accum == "auto"
    with pytest.raises(SystemExit):
        parser().parse_args(["optimize", "m.py", "--fp8-fast-accum", "maybe"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["optimize", "--help"])
    assert "--fp8-fast-accum" in capsys.readouterr().out


def test_api_option_maps_to_the_field(tmp_path):
    from tctune.api import tune_config

    assert tune_config({"fp8_fast_accum": "on"}, out_dir=tmp_path).fp8_fast_accum == "on"


# ---------------------------------------------------------------------------------------- search space


@pytest.mark.parametrize("target,expected", [("h200", (False, True)), ("sm_89", (False, True)),
                                             ("a100", (False,)), ("sm_80", (False,))])
def test_auto_offers_fast_accum_only_where_fp8_is_searched_on_ada_and_hopper(target, expected):
    hw = resolve(target)
    precisions = hw.search_precisions(measure_on_gpu=True)
    assert ("fp8" in precisions) == (expected == (False, True))
    assert fp8_fast_accum_choices(precisions, hw.arch, "auto") == expected
    assert fp8_fast_accum_choices(hw.search_precisions(measure_on_gpu=False), hw.arch, "auto") == (False,)
    assert fp8_fast_accum_choices(hw.search_precisions(True, training=True), hw.arch, "on") == (False,)


def test_on_and_off_pin_it_and_a_bad_mode_raises():
    fp8 = ("fp32", "bf16", "fp8")
    assert fp8_fast_accum_choices(fp8, "Hopper", "on") == (True,)
    assert fp8_fast_accum_choices(fp8, "Blackwell", "on") == (True,)
    assert fp8_fast_accum_choices(fp8, "Hopper", "off") == (False,)
    assert fp8_fast_accum_choices(fp8, "Blackwell", "auto") == (False,)  # not measured there
    with pytest.raises(ValueError, match="auto, on or off"):
        fp8_fast_accum_choices(fp8, "Hopper", "yes")


# ------------------------------------------------------------------------------------- the decision


def _speeds(full, fast, calls):
    def throughput_of(flag):
        calls.append(flag)
        return fast if flag else full
    return throughput_of


def test_kept_when_under_the_aim_and_faster():
    calls = []
    check = choose_fast_accum(("lm_head",), 0.045, lambda: 0.031, _speeds(100.0, 110.0, calls), error_full=0.030)
    assert check.kept and calls == [False, True] and check.speeds == {"full": 100.0, "fast": 110.0}
    assert check.keep == ("lm_head",) and check.error == 0.031 and check.error_full == 0.030
    assert check.summary().startswith("fast accumulation on: error 3.10e-02 (full accumulation: 3.00e-02)")
    assert json.loads(json.dumps(check.to_dict()))["kept"] is True


def test_not_timed_when_over_the_aim_and_nan_counts_as_over():
    calls = []
    for err in (0.05, math.nan):
        check = choose_fast_accum((), 0.045, lambda: err, _speeds(100.0, 200.0, calls), metric=METRIC_SCORE)
        assert not check.kept and "over the aim 4.50e-02" in check.reason and "score shortfall" in check.reason
    assert calls == []


def test_not_kept_under_the_minimum_gain_and_a_timed_full_graph_is_not_timed_again():
    calls = []
    gain = 1 + FAST_ACCUM_MIN_GAIN / 2
    check = choose_fast_accum((), 0.045, lambda: 0.01, _speeds(None, 100.0 * gain, calls), speed_full=100.0)
    assert not check.kept and calls == [True] and "under the 1% gain" in check.reason


def test_a_failing_graph_keeps_full_accumulation():
    def boom():
        raise RuntimeError("no kernel\nsecond line")
    check = choose_fast_accum((), 0.045, boom, _speeds(100.0, 200.0, []))
    assert not check.kept and check.error is None and "failed to run (no kernel)" in check.reason
    check = choose_fast_accum((), 0.045, lambda: 0.01, _speeds(100.0, None, []))
    assert not check.kept and "with it could not be timed" in check.reason


# ------------------------------------------------------------------------------------- through the Tuner

STACK_FILE = '''
import torch
from torch import nn

class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))

def build_model():
    torch.manual_seed(0)
    return Stack()

def example_inputs(batch_size):
    return (torch.randn(batch_size, 16, 64),)
'''
PARAMS = {"batch_size": 4, "precision": "fp8", "graph_passes": True, "runtime": "eager", "policy": "pure"}


def _tuner(tmp_path, choices, **kw) -> Tuner:
    tmp_path.mkdir(parents=True, exist_ok=True)
    f = tmp_path / "stack.py"
    f.write_text(STACK_FILE)
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4,), **kw)
    tuner = Tuner(cfg, load_model_file(f), resolve("h200"), device=torch.device("cpu"))
    assert tuner.search_space.fp8_fast_accum == (False,)  # the CPU does not search fp8
    tuner.evaluator.fp8_fast_accum_choices = choices  # as on an H200
    return tuner


@zoo.SCALED_MM_ROW
def test_the_study_checks_fast_accum_once_and_its_fp8_trials_record_it(tmp_path, monkeypatch):
    tuner = _tuner(tmp_path, (False, True), fp8_keep=("down",), max_error_fp8=0.05)
    timed = []

    def fake_throughput(self, policy, keep, inputs, fast_accum=False):
        timed.append((policy, keep, fast_accum))
        return 120.0 if fast_accum else 100.0

    monkeypatch.setattr(InferenceEvaluator, "_fp8_throughput", fake_throughput)
    metrics = tuner.evaluate(PARAMS)

    check = tuner.evaluator.fast_accum_checks["pure"]
    assert check.kept and check.keep == ("down",) and 0 < check.error <= check.target == pytest.approx(0.045)
    assert timed == [("pure", ("down",), False), ("pure", ("down",), True)]
    assert metrics["fp8_fast_accum"] is True and metrics["fp8_keep"] == ["down"]
    assert metrics["description"].endswith("(bf16: down), fast accumulation, eager")
    assert metrics["max_rel_error"] < 0.05
    cand = tuner.build(PARAMS)
    assert [n.kwargs["use_fast_accum"] for n in _scaled_mms(cand.module)] == [True]
    # another policy reuses the decision; a bf16 trial records nothing
    assert tuner.evaluator.fp8_fast_accum("autocast", 4) is True and len(timed) == 2
    assert tuner.evaluator.fast_accum_checks["autocast"].reused_from == "pure"
    assert "fp8_fast_accum" not in tuner.evaluate({**PARAMS, "precision": "bf16"})
    # a recorded trial is rebuilt as it was measured: its own value, or False when only its keep-list was recorded
    assert tuner.trial_params(PARAMS, ["down"], False).fp8_fast_accum is False
    assert tuner.trial_params(PARAMS, ["down"]).fp8_fast_accum is False
    assert tuner.trial_params(PARAMS, ["down"], True).fp8_fast_accum is True


@zoo.SCALED_MM_ROW
def test_a_slower_or_too_inaccurate_fast_graph_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(InferenceEvaluator, "_fp8_throughput",
                        lambda self, policy, keep, inputs, fast_accum=False: 100.0)
    tuner = _tuner(tmp_path / "a", (False, True), fp8_keep=("down",))
    assert tuner.evaluate(PARAMS)["fp8_fast_accum"] is False
    assert "under the 1% gain" in tuner.evaluator.fast_accum_checks["pure"].reason

    monkeypatch.setattr(InferenceEvaluator, "_fp8_throughput",
                        lambda *a, **k: pytest.fail("an FP8 graph over the aim is not timed"))
    tuner = _tuner(tmp_path / "b", (False, True), fp8_keep=("down",), max_error_fp8=1e-6)
    assert tuner.evaluator.fp8_fast_accum("pure", 4) is False
    assert "over the aim" in tuner.evaluator.fast_accum_checks["pure"].reason


@zoo.SCALED_MM_ROW
def test_the_cpu_says_the_flag_has_no_effect(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="tctune"):
        _tuner(tmp_path, (False,), fp8_fast_accum="on")
    assert "--fp8-keep / --max-error-fp8 / --fp8-fast-accum have no effect" in caplog.text


def test_pinned_on_or_off_builds_without_a_check(tmp_path, monkeypatch):
    monkeypatch.setattr(InferenceEvaluator, "_check_fast_accum", lambda *a: pytest.fail("pinned: nothing to check"))
    for choices in ((True,), (False,)):
        tuner = _tuner(tmp_path / str(choices[0]), choices, fp8_keep=("down",))
        cand = tuner.build(PARAMS)
        assert [n.kwargs["use_fast_accum"] for n in _scaled_mms(cand.module)] == [choices[0]]
        assert tuner.evaluator.fast_accum_checks == {}


def test_the_report_shows_the_decision_and_each_fp8_trials_value():
    from tctune.report import render_markdown

    check = FastAccumCheck(True, ("down",), 0.031, 0.045, "error 3.10e-02, aim 4.50e-02; 120 against 100 items/s")
    r = {"hardware": {}, "model": {"name": "m", "path": "m.py"}, "measured_on": "cpu",
         "study": {"name": "s", "n_trials": 0, "n_complete": 0}, "config": {"max_error": 0.01},
         "capture": {"ok": True}, "best": None, "baseline": None, "passes": [], "trials": [], "artifacts": {},
         "fp8_fast_accum": {"pure": json.loads(json.dumps(check.to_dict()))}}
    md = render_markdown(r)
    assert "## FP8 fast accumulation" in md and "- pure policy: fast accumulation on: error 3.10e-02" in md


# ---------------------------------------------------------------------------------------------- backend


def test_backend_option_defaults_off_is_checked_and_reaches_the_pass_spec():
    import tctune.backend as tb

    assert tb.BackendConfig().fp8_fast_accum is False
    assert "fp8_fast_accum" in tb._OPTION_KEYS
    with pytest.raises(ValueError, match="fp8_fast_accum must be True or False"):
        tb.backend(fp8_fast_accum="on")
    hw = resolve("h200")
    assert tb._spec_for(hw, False, "pure", "fp8", (), "fp32", True).fp8_fast_accum is True
    assert tb._spec_for(hw, False, "pure", "fp8").fp8_fast_accum is False
    assert tb._spec_for(hw, False, "pure", "bf16", (), "fp32", True).fp8_fast_accum is False
