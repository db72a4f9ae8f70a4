"""Tests for tctune.fp8_plan: the FP8 keep-list chosen from measured error, and its use by the search."""
from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch
from torch import nn

import zoo
from tctune.errors import CandidateRejected, UsageError
from tctune.fp8_plan import (MAX_ALTERNATIVES, SAME_ROLES, FP8Plan, choose_fastest, keep_label, kept_roles,
                              linear_roles, plan_fp8_keep, role)
from tctune.hardware import resolve
from tctune.modelfile import load_model_file
from tctune.search import InferenceEvaluator, TuneConfig, Tuner


def test_role_replaces_layer_indices_only():
    assert role("bert.encoder.layer.11.output.dense") == "bert.encoder.layer.*.output.dense"
    assert role("blocks.0.mlp.fc1") == "blocks.*.mlp.fc1"
    assert role("fc2") == "fc2" and role("layer10x.dense") == "layer10x.dense"
    assert role("0.fc") == "*.fc" and role("seq.3") == "seq.*" and role("a.1b.2") == "a.1b.*"


class Stack(nn.Module):
    """Two identical blocks (up 64->128, down 128->64) and an odd head 64->61 (not FP8-eligible)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(64, 128), "down": nn.Linear(128, 64)})
                                    for _ in range(2))
        self.head = nn.Linear(64, 61)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b["down"](torch.relu(b["up"](x)))
        return self.head(x)


def test_linear_roles_group_layers_and_count_flops():
    torch.manual_seed(0)
    gm = zoo.capture(Stack().eval(), (torch.randn(3, 5, 64),))

    roles = linear_roles(gm)

    assert set(roles) == {"blocks.*.up", "blocks.*.down"}  # the 61-wide head is not FP8-eligible
    assert roles["blocks.*.up"] == roles["blocks.*.down"] == 2 * (2 * 15 * 64 * 128)


def test_linear_roles_count_conv1d_style_addmm_and_mm():
    from test_passes_fp8 import KNBlock

    torch.manual_seed(0)
    gm = zoo.capture(KNBlock().eval(), (torch.randn(2, 5, 64),))

    roles = linear_roles(gm)

    rows = 2 * 5
    assert roles == {"up": 2 * rows * 64 * 128, "down": 2 * rows * 128 * 64, "sq": 2 * rows * 64 * 64}


def _additive(base: float, gains: dict[str, float], calls: list):
    def error_of(keep):
        calls.append(keep)
        return base - sum(gains[k] for k in keep)
    return error_of


def test_greedy_keeps_the_best_error_per_flop_until_under_the_aim():
    roles = {"a": 10.0, "b": 1.0, "c": 5.0}
    calls: list = []

    plan = plan_fp8_keep(roles, _additive(0.1, {"a": 0.05, "b": 0.04, "c": 0.01}, calls), max_error=0.05)

    # step 1: b gains 0.04 per FLOP (best) -> 0.06 > 0.045; step 2: a (0.005/FLOP) beats c (0.002) -> 0.01
    assert plan.keep == ("b", "a") and plan.usable and plan.reason is None
    assert plan.error == pytest.approx(0.01) and plan.target == pytest.approx(0.045)
    assert plan.fp8_flop_share == pytest.approx(5 / 16)
    # then trying to release a -> (b,), then b -> (a,): both needed, both measured in round 1 (not measured again)
    assert calls == [(), ("a",), ("b",), ("c",), ("b", "a"), ("b", "c")]
    assert [(s.get("release"), s["keep"], s["error"]) for s in plan.steps[-2:]] == [
        ("a", ["b"], pytest.approx(0.06)), ("b", ["a"], pytest.approx(0.05))]
    assert [s["keep"] for s in plan.steps][:1] == [[]]
    assert "b, a stays bf16" in plan.summary() and "31% of the linear FLOPs" in plan.summary()


def test_a_role_kept_early_is_dropped_when_a_measured_list_suffices():
    errors = {(): 0.1, ("b",): 0.08, ("a",): 0.04, ("c",): 0.05, ("b", "a"): 0.03, ("b", "c"): 0.04}
    calls: list = []

    def error_of(keep):
        calls.append(keep)
        return errors[tuple(keep)]

    plan = plan_fp8_keep({"a": 10.0, "b": 1.0, "c": 20.0}, error_of, max_error=0.05)

    # greedy: b (0.02 per FLOP) then a -> 0.03; but (a,) alone, measured in round 1, was under the aim at 0.04
    # with more FLOPs in FP8: it is picked, no graph measured again (releasing its one role is all-FP8)
    assert plan.keep == ("a",) and plan.error == 0.04 and plan.fp8_flop_share == pytest.approx(21 / 31)
    assert calls == [(), ("a",), ("b",), ("c",), ("b", "a"), ("b", "c")]
    assert plan.steps[-1] == {"keep": ["a"], "error": 0.04, "picked": "most FP8 FLOPs of the measured keep-lists"}


def test_a_measured_keep_list_with_more_fp8_flops_beats_the_greedy_path():
    """GPT-2's case on the CPU: the greedy's last round kept the role with the best error per FLOP, while the
    other keep-list of that round was also under the aim and left more FLOPs in FP8."""
    roles = {"x": 1.0, "y": 3.0, "h": 4.0}
    table = {(): 0.10, ("x",): 0.09, ("y",): 0.085, ("h",): 0.075,
             ("x", "y"): 0.044, ("h", "x"): 0.02}
    calls: list = []

    def error_of(keep):
        calls.append(tuple(keep))
        return table[tuple(sorted(keep))]

    plan = plan_fp8_keep(roles, error_of, max_error=0.05)

    # round 1 keeps x (0.01 per FLOP); round 2: h gains 0.07 / 4 = 0.0175 per FLOP, y 0.046 / 3 = 0.0153, so the
    # greedy ends at (x, h) with y in FP8 (3/8); (x, y), measured in that round at 0.044, leaves h (4/8) in FP8
    assert plan.keep == ("x", "y") and plan.error == 0.044 and plan.fp8_flop_share == pytest.approx(4 / 8)
    picked = [s for s in plan.steps if "picked" in s]
    assert len(picked) == 1 and picked[0]["keep"] == ["x", "y"]
    assert calls[:6] == [(), ("x",), ("y",), ("h",), ("x", "y"), ("x", "h")]
    # then releasing y -> (x,), then x -> (y,): both needed, both lists of round 1, so no graph measured again
    assert len(calls) == 6 and [(s["release"], s["keep"]) for s in plan.steps[-2:]] == [("y", ["x"]), ("x", ["y"])]


def test_the_greedy_list_stands_when_nothing_measured_runs_more_in_fp8():
    roles = {"x": 1.0, "y": 3.0, "h": 4.0}
    table = {(): 0.10, ("x",): 0.09, ("y",): 0.085, ("h",): 0.075, ("x", "y"): 0.05, ("h", "x"): 0.02}

    plan = plan_fp8_keep(roles, lambda keep: table[tuple(sorted(keep))], max_error=0.05)

    assert plan.keep == ("x", "h") and plan.fp8_flop_share == pytest.approx(3 / 8)
    assert not any("picked" in s for s in plan.steps)


def _four_role_plan():
    """Four roles whose greedy keeps a, c, b (0.03), then releases a: (c, b) at 0.04, d in FP8 (11/16)."""
    roles = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 10.0}
    table = {(): 0.10, ("a",): 0.08, ("b",): 0.09, ("c",): 0.09, ("d",): 0.05,
             ("a", "b"): 0.07, ("a", "c"): 0.05, ("a", "d"): 0.06,
             ("a", "b", "c"): 0.03, ("a", "c", "d"): 0.01, ("b", "c"): 0.04}
    return plan_fp8_keep(roles, lambda keep: table[tuple(sorted(keep))], max_error=0.05)


def test_a_role_kept_early_is_released_when_the_later_ones_suffice():
    plan = _four_role_plan()

    # greedy: a, then c, then b -> 0.03 (d in FP8, 10/16); release c -> 0.07, b -> 0.05, a -> 0.04: a released
    assert plan.keep == ("c", "b") and plan.error == 0.04 and plan.fp8_flop_share == pytest.approx(11 / 16)
    assert plan.steps[-1]["release"] == "a"


def test_alternatives_are_the_distinct_measured_lists_under_the_aim_most_fp8_first():
    plan = _four_role_plan()

    # under the aim 0.045: (b, c) 11/16 FP8 (the choice), (a, b, c) 10/16, (a, c, d) 2/16; nothing twice
    assert [sorted(a["keep"]) for a in plan.alternatives] == [["b", "c"], ["a", "b", "c"], ["a", "c", "d"]]
    assert [a["error"] for a in plan.alternatives] == [0.04, 0.03, 0.01]
    assert plan.alternatives[0]["fp8_flop_share"] == pytest.approx(11 / 16) and MAX_ALTERNATIVES == 3
    assert plan.speeds == [] and "timed" not in plan.summary()


def test_choose_fastest_takes_the_fastest_alternative_and_says_so():
    plan = _four_role_plan()
    timed: list = []

    def throughput_of(keep):
        timed.append(tuple(sorted(keep)))
        return {("b", "c"): 100.0, ("a", "b", "c"): 130.0, ("a", "c", "d"): None}[tuple(sorted(keep))]

    plan = choose_fastest(plan, throughput_of)

    assert timed == [("b", "c"), ("a", "b", "c"), ("a", "c", "d")]
    assert sorted(plan.keep) == ["a", "b", "c"] and plan.error == 0.03 and plan.fp8_flop_share == pytest.approx(10 / 16)
    assert plan.speeds == [100.0, 130.0, None]
    assert ("the fastest of 3 keep-lists under the aim, timed (bf16 kept: items/s): c, b: 100; a, c, b: 130; "
            "a, c, d: failed") in plan.summary()
    assert plan.to_dict()["speeds"] == [100.0, 130.0, None]


def _layered(gains: dict[str, float], base: float = 0.1):
    """Error model over single layers: ``base`` minus the gain of every layer a keep-list pattern matches."""
    from fnmatch import fnmatchcase

    def error_of(keep):
        return base - sum(g for p, g in gains.items() if any(fnmatchcase(p, k) for k in keep))
    return error_of


def _roles_of(layers):
    roles: dict[str, float] = {}
    for p, f in layers.items():
        roles[role(p)] = roles.get(role(p), 0.0) + f
    return roles


def test_kept_roles_map_single_layers_to_their_role():
    assert kept_roles(["l.*.q", "l.4.q", "l.0.d", "head"]) == {"l.*.q", "l.*.d", "head"}
    assert kept_roles([]) == frozenset()


def _expand(label: str) -> set[str]:
    """The entries a :func:`keep_label` string stands for: each ``{…}`` (``a-b``: a to b; ``a,b``: each) expanded."""
    out = set()
    for entry in re.split(r", (?![^{]*})", label):
        m = re.search(r"\{([^}]*)}", entry)
        if m is None:
            out.add(entry)
            continue
        for run in m.group(1).split(","):
            a, _, b = run.partition("-")
            out |= {entry[:m.start()] + str(i) + entry[m.end():] for i in range(int(a), int(b or a) + 1)}
    return out


def test_keep_label_writes_a_roles_layers_as_ranges_in_numeric_order():
    h = "lm.transformer.h"
    fc = [f"{h}.{i}.mlp.c_fc" for i in (0, 1, 2, 3, 5, 6, 7, 8, 9)]
    attn = [f"{h}.{i}.attn.c_attn" for i in sorted(range(21), key=str) if i not in (11, 12, 13, 14, 15, 16, 17)]
    keep = [f"{h}.*.attn.c_proj", f"{h}.*.mlp.c_proj", *fc, *attn]  # 18, 19, 2, 20 in string order

    label = keep_label(keep)

    assert label == (f"{h}.*.attn.c_proj, {h}.*.mlp.c_proj, {h}.{{0-3,5-9}}.mlp.c_fc, "
                     f"{h}.{{0-10,18-20}}.attn.c_attn")
    assert _expand(label) == set(keep)


def test_keep_label_single_index_pairs_and_every_layer():
    assert keep_label(["l.4.q"]) == "l.4.q"  # one layer of its role: the plain path
    assert keep_label(["l.5.q", "l.4.q", "l.7.q"]) == "l.{4,5,7}.q"  # a run of two is not a range
    assert keep_label(["l.3.q", "l.*.q", "l.0.q", "l.1.d"]) == "l.*.q, l.1.d"  # every layer: the role's `*`
    assert keep_label(["l.*.q", "l.*.d"]) == "l.*.q, l.*.d" and keep_label([]) == ""


def test_keep_label_leaves_other_entries_as_given():
    # no layer index, user patterns (fnmatch), an index with a leading zero, a repeat
    keep = ["lm_head", "l.1.q", "*.output.dense", "l.0?.q", "l.[12].d", "l.01.q", "l.2.q", "layer10x.dense", "lm_head"]
    assert keep_label(keep) == "lm_head, l.{1,2}.q, *.output.dense, l.0?.q, l.[12].d, l.01.q, layer10x.dense"
    # several indices: grouped over the last, the groups in numeric order of the others
    keep = ["s.10.b.1.attn", "s.2.b.0.attn", "s.2.b.3.attn", "s.2.b.1.attn", "s.2.b.2.attn", "s.0.b.2.attn"]
    assert keep_label(keep) == "s.0.b.2.attn, s.2.b.{0-3}.attn, s.10.b.1.attn"
    assert _expand(keep_label(keep)) == set(keep)


def test_keep_label_is_lossless_on_random_keep_lists():
    rng = random.Random(0)
    for _ in range(200):
        keep = [f"m.{rng.randrange(40)}.{r}" for r in rng.choices(("q", "k", "out"), k=rng.randrange(1, 60))]
        keep += rng.sample(["m.*.ffn", "head", "m.0.x.1"], rng.randrange(4))
        rng.shuffle(keep)
        label = keep_label(keep)
        assert _expand(label) == set(keep)
        assert keep_label(label.split(", ")) == label  # a label read back is written the same


def test_plan_summary_writes_keep_lists_with_keep_label():
    layers = {f"l.{i}.{r}": 1.0 for i in range(12) for r in ("q", "d")}
    keep = tuple(f"l.{i}.q" for i in (0, 1, 2, 3, 5, 10, 11))
    alt = ("l.*.d",)
    plan = FP8Plan(keep, 0.01, 0.045, 17 / 24, _roles_of(layers), [{"keep": [], "error": 0.1}],
                   alternatives=[{"keep": list(keep), "error": 0.01, "fp8_flop_share": 17 / 24},
                                 {"keep": list(alt), "error": 0.02, "fp8_flop_share": 0.5}],
                   speeds=[120.0, 100.0])
    s = plan.summary()
    assert s.startswith("FP8 keep-list l.{0-3,5,10,11}.q stays bf16; 71% of the linear FLOPs run FP8")
    assert "(bf16 kept: items/s): l.{0-3,5,10,11}.q: 120; l.*.d: 100" in s and "l.10.q" not in s
    assert plan.to_dict()["keep"] == list(keep)  # the machine-readable list stays exact


def test_alternatives_keeping_the_same_roles_are_collapsed_and_not_timed():
    """The per-layer step leaves keep-lists that differ only in single layers of one role: one alternative, the
    most FP8 FLOPs, and no timing at all."""
    layers = {f"l.{i}.{r}": 1.0 for i in range(3) for r in ("q", "d")}
    gains = {"l.0.q": 0.002, "l.1.q": 0.003, "l.2.q": 0.06, "l.0.d": 0.001, "l.1.d": 0.001, "l.2.d": 0.001}

    plan = plan_fp8_keep(_roles_of(layers), _layered(gains), max_error=0.05, layers=layers)

    # greedy keeps l.*.q (0.035); layer 0 then layer 1 go back to FP8 (0.037, 0.040): three lists under the aim
    assert plan.keep == ("l.2.q",) and plan.fp8_flop_share == pytest.approx(5 / 6)
    assert plan.alternatives == [{"keep": ["l.2.q"], "error": pytest.approx(0.04),
                                  "fp8_flop_share": pytest.approx(5 / 6)}]
    assert [(c["keep"], c["into"], c["why"]) for c in plan.collapsed] == [
        (["l.1.q", "l.2.q"], ["l.2.q"], SAME_ROLES), (["l.*.q"], ["l.2.q"], SAME_ROLES)]
    assert [c["fp8_flop_share"] for c in plan.collapsed] == [pytest.approx(4 / 6), pytest.approx(3 / 6)]

    plan = choose_fastest(plan, lambda keep: pytest.fail("one set of roles: nothing to time"))

    assert plan.keep == ("l.2.q",) and plan.speeds == []
    assert plan.summary().endswith(f"; 2 more keep-lists under the aim not timed ({SAME_ROLES})")
    d = json.loads(json.dumps(plan.to_dict()))
    assert [c["keep"] for c in d["collapsed"]] == [["l.1.q", "l.2.q"], ["l.*.q"]] and d["speeds"] == []


def test_alternatives_keeping_different_roles_are_all_timed():
    layers = {f"l.{i}.{r}": 1.0 for i in range(3) for r in ("q", "d")}
    gains = {"l.0.q": 0.002, "l.1.q": 0.012, "l.2.q": 0.051, "l.0.d": 0.02, "l.1.d": 0.02, "l.2.d": 0.02}
    plan = plan_fp8_keep(_roles_of(layers), _layered(gains), max_error=0.05, layers=layers)
    # under the aim 0.045: (l.1.q, l.2.q) 4/6 FP8, l.*.q 3/6 (0.035), l.*.d 3/6 (0.04); the first two keep q
    assert plan.keep == ("l.1.q", "l.2.q")
    assert [a["keep"] for a in plan.alternatives] == [["l.1.q", "l.2.q"], ["l.*.d"]]
    assert [(c["keep"], c["into"]) for c in plan.collapsed] == [(["l.*.q"], ["l.1.q", "l.2.q"])]
    timed: list = []

    def throughput_of(keep):
        timed.append(keep)
        return {("l.1.q", "l.2.q"): 90.0, ("l.*.d",): 100.0}[keep]

    plan = choose_fastest(plan, throughput_of)

    assert timed == [("l.1.q", "l.2.q"), ("l.*.d",)]  # once per set of roles
    assert plan.keep == ("l.*.d",) and plan.error == pytest.approx(0.04) and plan.speeds == [90.0, 100.0]
    assert plan.summary().endswith(f"timed (bf16 kept: items/s): l.{{1,2}}.q: 90; l.*.d: 100; 1 more keep-list "
                                   f"under the aim not timed ({SAME_ROLES})")
    assert plan.to_dict()["collapsed"][0]["into"] == ["l.1.q", "l.2.q"]


def test_choose_fastest_collapses_a_plan_built_by_hand():
    """A plan whose alternatives were not collapsed (built by hand): the same rule before timing; of two lists
    with the same FP8 FLOPs and roles the one with the lower error is timed."""
    alts = [{"keep": ["l.0.q"], "error": 0.03, "fp8_flop_share": 0.8},
            {"keep": ["l.1.q"], "error": 0.02, "fp8_flop_share": 0.8},
            {"keep": ["l.*.q"], "error": 0.01, "fp8_flop_share": 0.5},
            {"keep": ["l.0.d"], "error": 0.04, "fp8_flop_share": 0.8}]
    plan = FP8Plan(("l.0.q",), 0.03, 0.045, 0.8, {"l.*.q": 1.0, "l.*.d": 1.0}, [{"keep": [], "error": 0.1}],
                   alternatives=list(alts))
    timed: list = []

    plan = choose_fastest(plan, lambda keep: timed.append(keep) or {("l.1.q",): 60.0, ("l.0.d",): 50.0}[keep])

    assert timed == [("l.1.q",), ("l.0.d",)] and plan.speeds == [60.0, 50.0] and plan.keep == ("l.1.q",)
    assert [(c["keep"], c["into"]) for c in plan.collapsed] == [(["l.0.q"], ["l.1.q"]), (["l.*.q"], ["l.1.q"])]
    one = FP8Plan(("l.0.q",), 0.03, 0.045, 0.8, {"l.*.q": 1.0}, [{"keep": [], "error": 0.1}], alternatives=alts[:3])
    one = choose_fastest(one, lambda keep: pytest.fail("one set of roles: nothing to time"))
    assert one.keep == ("l.1.q",) and one.error == 0.02 and len(one.collapsed) == 2 and one.speeds == []


def test_choose_fastest_leaves_a_single_or_untimed_plan_alone():
    one = plan_fp8_keep({"a": 1.0, "b": 1.0}, lambda keep: 0.01, max_error=0.05)  # all FP8 at once: one list
    assert len(one.alternatives) == 1
    assert choose_fastest(one, lambda keep: pytest.fail("must not time")).speeds == []
    failed = choose_fastest(_four_role_plan(), lambda keep: None)  # none could be timed: the error plan stands
    assert failed.keep == ("c", "b") and failed.speeds == [None, None, None] and "c, b: failed" in failed.summary()
    none = plan_fp8_keep({"a": 1.0, "b": 2.0}, lambda keep: 0.2, max_error=0.05)  # nothing fits
    assert not none.usable and none.alternatives == [] and choose_fastest(none, lambda k: 1.0) is none


def test_all_fp8_when_already_under_the_aim():
    calls: list = []
    plan = plan_fp8_keep({"a": 1.0, "b": 1.0}, _additive(0.01, {"a": 0, "b": 0}, calls), max_error=0.05)
    assert plan.keep == () and plan.fp8_flop_share == 1.0 and calls == [()]
    assert "every FP8-eligible linear runs FP8" in plan.summary()


def test_no_fp8_when_no_group_can_stay_fp8():
    plan = plan_fp8_keep({"a": 1.0, "b": 2.0}, lambda keep: 0.2 - 0.01 * len(keep), max_error=0.05)
    assert not plan.usable and plan.fp8_flop_share == 0 and set(plan.keep) == {"a", "b"}
    assert "FP8 cannot meet --max-error-fp8 0.05" in plan.reason and "2.00e-01" in plan.reason


def test_nan_error_counts_as_over_the_limit():
    plan = plan_fp8_keep({"a": 1.0, "b": 1.0}, lambda keep: math.nan if "a" not in keep else 0.001, max_error=0.05)
    assert plan.keep == ("a",) and plan.usable and plan.fp8_flop_share == 0.5


def test_no_eligible_linear_and_bad_arguments():
    assert "no linear is FP8-eligible" in plan_fp8_keep({}, lambda k: 0.0, 0.05).reason
    with pytest.raises(ValueError, match="margin"):
        plan_fp8_keep({"a": 1.0}, lambda k: 0.0, 0.05, margin=0)
    with pytest.raises(ValueError, match="max_error"):
        plan_fp8_keep({"a": 1.0}, lambda k: 0.0, 0.0)


# ------------------------------------------------------------------------------------- through the Tuner

STACK_FILE = '''
import torch
from torch import nn

class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(64, 256), "down": nn.Linear(256, 64)})
                                    for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = x + b["down"](torch.nn.functional.gelu(b["up"](x)))
        return x

def build_model():
    torch.manual_seed(0)
    return Stack()

def example_inputs(batch_size):
    return (torch.randn(batch_size, 16, 64),)
'''


def _tuner(tmp_path, **kw) -> Tuner:
    f = tmp_path / "stack.py"
    f.write_text(STACK_FILE)
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4,), **kw)
    return Tuner(cfg, load_model_file(f), resolve("h200"), device=torch.device("cpu"))


@zoo.SCALED_MM_ROW
def test_tuner_plans_once_per_policy_and_builds_the_planned_graph(tmp_path):
    tuner = _tuner(tmp_path, max_error_fp8=0.05)
    loose = tuner.evaluator.fp8_keep("pure", 4)
    assert loose == () and set(tuner.fp8_plans) == {"pure"}
    assert tuner.fp8_plans["pure"].roles.keys() == {"blocks.*.up", "blocks.*.down"}

    # an aim between the all-FP8 error and zero: the plan must keep something, and the candidate has it
    all_fp8 = tuner.fp8_plans["pure"].steps[0]["error"]
    tuner = _tuner(tmp_path, max_error_fp8=all_fp8 * 0.8)
    keep = tuner.evaluator.fp8_keep("pure", 4)
    plan = tuner.fp8_plans["pure"]
    assert keep and plan.usable and plan.error <= plan.target < all_fp8
    cand = tuner.build({"batch_size": 4, "precision": "fp8", "graph_passes": True, "runtime": "eager", "policy": "pure"})
    fp8 = next(r for r in cand.passes if r.name == "cast_fp8_linears")
    assert any("FP8 keep-list" in s.reason for s in fp8.skipped) and fp8.count > 0
    assert "bf16: " in cand.description
    inputs, ref = tuner.reference(4)
    with torch.inference_mode():
        out = cand.module(*inputs)
    assert zoo.rel_l2(out.float(), ref) <= all_fp8 * 0.8


@zoo.SCALED_MM_ROW
def test_a_second_policy_reuses_the_first_plan_without_planning_again(tmp_path, monkeypatch):
    tuner = _tuner(tmp_path, max_error_fp8=0.05)
    first = tuner.evaluator.fp8_keep("pure", 4)
    monkeypatch.setattr(InferenceEvaluator, "_plan_fp8", lambda *a: pytest.fail("must not plan again"))
    assert tuner.evaluator.fp8_keep("autocast", 4) == first
    plan = tuner.fp8_plans["autocast"]
    assert plan.reused_from == "pure" and plan.policy == "autocast" and tuner.fp8_plans["pure"].reused_from is None
    assert plan.to_dict()["reused_from"] == "pure"
    if plan.keep:
        assert "planned under the pure policy and reused" in plan.summary()
    # the reusing policy's FP8 graph is still built and checked like any candidate
    cand = tuner.build({"batch_size": 4, "precision": "fp8", "graph_passes": True, "runtime": "eager",
                        "policy": "autocast"})
    assert next(r for r in cand.passes if r.name == "cast_fp8_linears").count > 0


@zoo.SCALED_MM_ROW
def test_tuner_times_the_plans_alternatives_and_builds_the_fastest(tmp_path, monkeypatch):
    tuner = _tuner(tmp_path, max_error_fp8=0.9)
    # every list is under this aim; make two alternatives by hand from the planned roles and time them for real
    from tctune.fp8_plan import FP8Plan
    roles = {"blocks.*.up": 1.0, "blocks.*.down": 1.0}
    plan = FP8Plan((), 0.01, 0.9, 1.0, roles, [{"keep": [], "error": 0.01}],
                   alternatives=[{"keep": [], "error": 0.01, "fp8_flop_share": 1.0},
                                 {"keep": ["blocks.*.down"], "error": 0.005, "fp8_flop_share": 0.5}])
    monkeypatch.setattr("tctune.search.evaluate.plan_graph", lambda *a, **k: plan)
    seen = []
    real = InferenceEvaluator._fp8_throughput

    def spy(self, policy, keep, inputs):
        v = real(self, policy, keep, inputs)
        seen.append((keep, v))
        return v

    monkeypatch.setattr(InferenceEvaluator, "_fp8_throughput", spy)

    keep = tuner.evaluator.fp8_keep("pure", 4)

    assert [k for k, _ in seen] == [(), ("blocks.*.down",)] and all(v and v > 0 for _, v in seen)
    fastest = max(seen, key=lambda kv: kv[1])[0]
    assert keep == fastest and tuner.fp8_plans["pure"].speeds == [v for _, v in seen]


def test_tuner_compiles_nothing_when_the_alternatives_keep_the_same_roles(tmp_path, monkeypatch):
    tuner = _tuner(tmp_path, max_error_fp8=0.9)
    plan = FP8Plan(("blocks.2.down",), 0.01, 0.9, 5 / 6, {"blocks.*.up": 1.0, "blocks.*.down": 1.0},
                   [{"keep": [], "error": 0.5}],
                   alternatives=[{"keep": ["blocks.2.down"], "error": 0.01, "fp8_flop_share": 5 / 6},
                                 {"keep": ["blocks.*.down"], "error": 0.005, "fp8_flop_share": 0.5}])
    monkeypatch.setattr("tctune.search.evaluate.plan_graph", lambda *a, **k: plan)
    monkeypatch.setattr(InferenceEvaluator, "_fp8_throughput", lambda *a: pytest.fail("must not compile or time"))

    assert tuner.evaluator.fp8_keep("pure", 4) == ("blocks.2.down",)
    assert tuner.fp8_plans["pure"].collapsed[0]["keep"] == ["blocks.*.down"]


@zoo.SCALED_MM_ROW
def test_fp8_trial_records_its_keep_list_for_the_export(tmp_path):
    tuner = _tuner(tmp_path, fp8_keep=("blocks.*.down",))
    params = {"batch_size": 4, "precision": "fp8", "graph_passes": True, "runtime": "eager", "policy": "pure"}
    metrics = tuner.evaluate(params)
    assert metrics["fp8_keep"] == ["blocks.*.down"] and metrics["max_rel_error"] < 5e-2
    assert "fp8_keep" not in tuner.evaluate({**params, "precision": "bf16"})


@zoo.SCALED_MM_ROW
def test_an_fp8_trials_name_writes_its_keep_list_compactly_and_the_report_keeps_the_exact_list(tmp_path):
    import optuna
    from tctune.report import build_report, render_markdown

    keep = ("blocks.2.up", "blocks.0.up", "blocks.1.up", "blocks.1.down")  # single layers, as the per-layer step leaves
    tuner = _tuner(tmp_path, fp8_keep=keep)
    params = {"batch_size": 4, "precision": "fp8", "graph_passes": True, "runtime": "eager", "policy": "pure"}
    metrics = tuner.evaluate(params)
    assert metrics["description"] == "tctune graph fp8 (bf16: blocks.{0-2}.up, blocks.1.down), eager"
    assert metrics["fp8_keep"] == list(keep)

    study = optuna.create_study(direction="maximize")
    dist = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()}
    base = dict(params, precision="fp32", graph_passes=False)
    for p, attrs in ((base, {"throughput": 100.0, "baseline": "fp32_eager", "max_rel_error": 0.0}),
                     (params, {**metrics, "throughput": 50.0})):  # slower: the report names it as the challenger
        study.add_trial(optuna.trial.create_trial(params=p, distributions=dist | {
            k: optuna.distributions.CategoricalDistribution([v]) for k, v in p.items()}, value=attrs["throughput"],
            user_attrs={"run_id": "r", **attrs}))
    r = build_report(study, hardware={}, measured_on="cpu", config={"max_error": 0.01, "mode": "infer"},
                     model={"name": "m", "path": "m.py"}, passes=[], artifacts={}, capture={"ok": True})
    fp8 = r["trials"][1]
    assert fp8["description"] == metrics["description"] and fp8["fp8_keep"] == list(keep)
    assert r["best"]["best_searched"]["description"] == metrics["description"]
    assert f"The fastest tctune candidate: trial 1 at batch {params['batch_size']} ({metrics['description']})" \
        in render_markdown(r)


@zoo.SCALED_MM_ROW
def test_a_trials_recorded_keep_list_is_what_its_re_measure_builds(tmp_path, monkeypatch):
    """Tuner.confirm rebuilds an FP8 trial with the keep-list it recorded, not a fresh plan (a resumed run)."""
    import optuna
    tuner = _tuner(tmp_path, max_error_fp8=0.05)
    monkeypatch.setattr(InferenceEvaluator, "fp8_keep", lambda self, policy, bs: pytest.fail("must not plan again"))
    params = {"batch_size": 4, "precision": "fp8", "graph_passes": True, "runtime": "eager", "policy": "pure"}
    study = optuna.create_study(direction="maximize")
    dist = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()}
    for keep, tp in ((["blocks.*.down"], 10.0), (["blocks.*.up"], 9.9)):
        study.add_trial(optuna.trial.create_trial(params=dict(params), distributions=dist, value=tp,
                                                  user_attrs={"throughput": tp, "max_rel_error": 0.0, "fp8_keep": keep}))
    seen = []
    real = Tuner.evaluate

    def spy(self, p, on_repeat=None, fp8_keep=None):
        seen.append(None if fp8_keep is None else tuple(fp8_keep))
        return real(self, p, on_repeat, fp8_keep)

    monkeypatch.setattr(Tuner, "evaluate", spy)
    conf = tuner.confirm(study)
    assert seen == [("blocks.*.down",), ("blocks.*.up",)] and all(v[1] for v in conf["runs"].values())


@zoo.SCALED_MM_ROW
def test_tuner_rejects_fp8_with_the_plans_reason_when_nothing_fits(tmp_path):
    tuner = _tuner(tmp_path, max_error_fp8=1e-9)
    with pytest.raises(CandidateRejected, match="FP8 cannot meet --max-error-fp8"):
        tuner.build({"batch_size": 4, "precision": "fp8", "graph_passes": True, "runtime": "eager", "policy": "pure"})
    assert not tuner.fp8_plans["pure"].usable


def test_explicit_keep_list_skips_planning(tmp_path):
    tuner = _tuner(tmp_path, fp8_keep=("blocks.*.down",))
    assert tuner.evaluator.fp8_keep("pure", 4) == ("blocks.*.down",) and tuner.fp8_plans == {}
    with pytest.raises(UsageError, match="fp8_keep must be") as err:
        TuneConfig(out_dir=str(tmp_path), fp8_keep="blocks.*")
    assert err.value.field == "fp8_keep"


def test_cli_parses_fp8_keep():
    from tctune.cli import parse_fp8_keep
    assert parse_fp8_keep("auto") is None and parse_fp8_keep("none") == ()
    assert parse_fp8_keep(" *.output.dense, lm_head ") == ("*.output.dense", "lm_head")
    with pytest.raises(UsageError, match="--fp8-keep"):
        parse_fp8_keep(" , ")


def test_report_lists_fp8_plans():
    from tctune.report import render_markdown
    plan = plan_fp8_keep({"a": 1.0, "b": 1.0}, lambda keep: 0.06 - 0.03 * len(keep), max_error=0.05).to_dict()
    r = {"hardware": {}, "model": {"name": "m", "path": "m.py"}, "measured_on": "cpu",
         "study": {"name": "s", "n_trials": 0, "n_complete": 0}, "config": {"max_error": 0.01},
         "capture": {"ok": True}, "best": None, "baseline": None, "passes": [], "trials": [], "artifacts": {},
         "fp8_plans": {"pure": json.loads(json.dumps(plan))}}
    md = render_markdown(r)
    assert "## FP8 keep-list" in md and "- pure policy: FP8 keep-list a stays bf16; 50% of the linear FLOPs" in md
