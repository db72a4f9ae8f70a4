"""Which linears run FP8: the FP8 keep-list, chosen by measuring each group's error on calibration inputs.

E4M3 keeps 3 mantissa bits, so every FP8 GEMM adds a relative rounding error of up to 2^-4 per operand, and
in a deep network the errors add up: on the H200, BERT-base (12 layers) with every linear in FP8 is 7.0e-2
from FP32 and BERT-large (24 layers) 1.25e-1, over the 5e-2 FP8 limit (benchmarks/RESULTS.md, "FP8 through
Inductor"). Which linears stay bf16 decides both the error and the speed (keeping BERT's ``*.output.dense`` was
more accurate *and* faster than all-FP8). So, like TensorRT Model Optimizer's per-layer exclusion, tctune
keeps some linears in bf16 — but it picks them by measurement rather than by a hand-written list:

1. Group the linears that ``cast_fp8_linears`` would quantize by *role*: their source module path with layer
   indices replaced by ``*`` (``bert.encoder.layer.*.output.dense``), an ``fnmatch`` pattern for
   ``PassSpec.fp8_keep``. A role's weight is its GEMM FLOPs in the captured graph.
2. Measure the error of the FP8 graph on the calibration inputs against the FP32 outputs with nothing kept.
3. While the error is above ``margin * max_error``: try keeping each remaining role in bf16 (one graph and
   one forward pass each), keep the role with the largest error reduction per FLOP given up, and repeat
   (greedy; at most R(R+1)/2 graphs for R roles: 10 for BERT's four).
4. Of every keep-list measured so far, the one under the aim with the most FP8 FLOPs is taken (the greedy
   path can miss it: on GPT-2 it ended with 23 % of the FLOPs in FP8 where a keep-list of its last round had
   31 %, no extra graph). The greedy's last step can also overshoot (on the H200 it kept BERT-base's FFN-up
   projections too and ended at 2.3e-2 against an aim of 4.5e-2), so each kept role, largest FLOPs first, is
   then tried back in FP8 and released when the error stays under the aim (one more graph per kept role).
5. FP8 FLOPs are not speed: up to ``MAX_ALTERNATIVES`` keep-lists under the aim (the distinct ones measured
   on the way, most FP8 FLOPs first) are candidates, and the search times them through its runtime and takes
   the fastest (:func:`choose_fastest`). Candidates that keep the same roles in bf16 (:func:`kept_roles`) are
   one alternative, the one with the most FP8 FLOPs; the others are listed as ``collapsed``, not timed.
6. Single layers: a role is every layer's copy of a linear, and often one or two layers carry its error. So,
   when the graph's layers are known (:func:`linear_layers`), each kept role with several layers is split:
   its layers, largest FLOPs first, are tried back in FP8 one at a time (the role's pattern replaced by the
   exact module paths of its layers still kept) and released while the error stays under the aim (one graph
   per layer, at most ``MAX_LAYER_RELEASES`` in all).
7. When every linear had to stay bf16, FP8 cannot meet the limit on this model: the plan says so (``reason``)
   and the search rejects its FP8 candidates with that sentence instead of measuring them.

The error minimized is the relative L2 error of the outputs on the calibration inputs, or, when the user gives
a task metric (``score(model)``, higher is better), the score shortfall ``1 - score / score_fp32``
(:class:`tctune.search.accuracy.ScoreGate.shortfall`) against the allowed shortfall (0.01 for the default
"99 % of FP32" rule): the same greedy, release and per-layer steps, with ``FP8Plan.metric`` saying which.

8. Fast accumulation (``torch._scaled_mm``'s ``use_fast_accum``, Hopper's faster, less precise FP8
   accumulation): where the study may choose it (``tctune.search.space.fp8_fast_accum_choices``), the chosen
   keep-list's FP8 graph is built once more with it, its error measured the same way against the same aim, and,
   when under the aim, timed against the same graph without it; it is kept when at least ``FAST_ACCUM_MIN_GAIN``
   faster (:func:`choose_fast_accum`, :class:`FastAccumCheck`). One more graph and one or two more compiles per
   study, against doubling the FP8 candidates the sampler would have to try as a searched parameter.

The margin (default 0.9) leaves room for the candidate's own check on its batch, which the search still
makes on fresh inputs: the plan is advice, the measured error decides.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Any, Callable, Sequence

import torch
from torch import fx

#: The plan aims at this fraction of the FP8 error limit, so that the candidate's own check still passes.
DEFAULT_MARGIN = 0.9
#: Keep-lists under the aim that :func:`choose_fastest` times (each costs one compile + timing in the search).
MAX_ALTERNATIVES = 3
#: Graphs the per-layer step (6.) may measure: BERT-base with two kept roles of 12 layers each costs 22.
MAX_LAYER_RELEASES = 32
#: Why a keep-list under the aim is not timed (``FP8Plan.collapsed``; :func:`choose_fastest` says why).
SAME_ROLES = "same roles kept in bf16 as a keep-list with more FP8 FLOPs"
#: The least throughput gain (a fraction) for which fast accumulation is kept: 1 %. A chosen threshold, not a
#: measurement: a smaller gain is hard to tell from the noise of two single timings and does not pay for the
#: extra rounding error; revisit with ``benchmarks/bench_fp8_accum.py``'s H200 numbers.
FAST_ACCUM_MIN_GAIN = 0.01
#: ``FP8Plan.metric`` values.
METRIC_L2 = "relative L2"
METRIC_SCORE = "score shortfall"

_INDEX = re.compile(r"(?<![^.])\d+(?![^.])")  # a whole dotted component of digits (nn.Sequential at the root too)
_GLOB = re.compile(r"[*?\[]")  # an fnmatch pattern, not a module path


@dataclass
class FP8Plan:
    """The chosen FP8 keep-list and how it was found.

    Attributes:
        keep: ``fnmatch`` patterns of the linears kept in bf16 (``PassSpec.fp8_keep``); ``()``: all FP8. Role
            patterns (``layer.*.output.dense``) and, after the per-layer step, exact module paths of single layers.
        error: the error of the FP8 graph with ``keep`` (``metric``): relative L2 error on the calibration inputs
            (largest over outputs), or the score shortfall ``1 - score / score_fp32``.
        target: the error the plan aimed at (``margin * max_error``).
        metric: :data:`METRIC_L2` or :data:`METRIC_SCORE`.
        fp8_flop_share: share of the eligible linears' FLOPs that run FP8 with ``keep`` (0 to 1).
        roles: every role (pattern) with its FLOPs in the captured graph.
        steps: the keep-lists tried, in order: ``{"keep": [...], "error": e}`` (one tried before is not measured
            again: its first error).
        reason: why no linear can run FP8 within the limit (then ``keep`` lists every role), else None.
        alternatives: the distinct keep-lists measured under the aim, most FP8 FLOPs first (at most
            ``MAX_ALTERNATIVES``, the plan's own choice among them or in ``collapsed``), one per set of roles
            kept (:func:`kept_roles`): ``{"keep", "error", "fp8_flop_share"}``.
        collapsed: keep-lists of the first ``MAX_ALTERNATIVES`` under the aim that keep the same roles as an
            alternative with more FP8 FLOPs (lower error on ties), not timed: each alternative's dict plus
            ``"into"`` (that alternative's keep-list) and ``"why"`` (:data:`SAME_ROLES`).
        speeds: after :func:`choose_fastest`: each alternative's measured throughput (items/s; None when it
            failed to run), in the order of ``alternatives``; empty when not timed (at most one alternative).
        reused_from: the policy whose plan this one copies (:meth:`reused`), else None.
    """

    keep: tuple[str, ...]
    error: float
    target: float
    fp8_flop_share: float
    roles: dict[str, float] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    reason: str | None = None
    alternatives: list[dict] = field(default_factory=list)
    speeds: list = field(default_factory=list)
    metric: str = METRIC_L2
    collapsed: list[dict] = field(default_factory=list)
    reused_from: str | None = None
    policy: str | None = None

    @property
    def usable(self) -> bool:
        return self.reason is None

    def reused(self, policy: str) -> "FP8Plan":
        """This plan's keep-list for the graphs of another cast ``policy``, without planning again.

        Planning costs up to ``MAX_LAYER_RELEASES`` graphs and ``MAX_ALTERNATIVES`` compiles (on the H200 about
        100 s per policy for BERT-base through Inductor), and the keep-list it finds depends on the linears'
        error, which the FP8 GEMMs set whatever the policy does with the ops around them. So a study plans once
        (for the first policy whose FP8 candidate runs) and reuses the keep-list; the reusing trial's own accuracy
        check on fresh inputs still decides whether it is feasible."""
        return replace(self, reused_from=self.policy or "another", policy=policy, speeds=[])

    def summary(self) -> str:
        """One line for the report and the log; keep-lists written by :func:`keep_label` (the exact ones:
        :meth:`to_dict`)."""
        if self.reason:
            return self.reason
        if not self.keep:
            return (f"every FP8-eligible linear runs FP8 ({self._what} {self.error:.2e}, aim {self.target:.2e})")
        timed = ""
        if self.speeds:
            def name(a):
                return keep_label(a["keep"]) or "nothing"
            timed = (f"; the fastest of {len(self.alternatives)} keep-lists under the aim, timed (bf16 kept: "
                     "items/s): " + "; ".join(f"{name(a)}: {v:,.0f}" if v else f"{name(a)}: failed"
                                             for a, v in zip(self.alternatives, self.speeds)))
        if self.collapsed:
            n = len(self.collapsed)
            timed += f"; {n} more keep-list{'s' if n > 1 else ''} under the aim not timed ({SAME_ROLES})"
        if self.reused_from:
            timed = f"; planned under the {self.reused_from} policy and reused (not re-planned)"
        return (f"FP8 keep-list {keep_label(self.keep)} stays bf16; {self.fp8_flop_share:.0%} of the linear FLOPs run "
                f"FP8 ({self._what} {self.error:.2e}, aim {self.target:.2e}; all-FP8: "
                f"{self.steps[0]['error']:.2e}){timed}")

    @property
    def _what(self) -> str:
        return "error on the calibration batch" if self.metric == METRIC_L2 else "score shortfall"


    def to_dict(self) -> dict:
        return {"summary": self.summary(), "keep": list(self.keep), "error": self.error, "target": self.target,
                "fp8_flop_share": self.fp8_flop_share, "roles": dict(self.roles), "steps": list(self.steps),
                "reason": self.reason, "alternatives": list(self.alternatives), "speeds": list(self.speeds),
                "metric": self.metric, "reused_from": self.reused_from, "collapsed": list(self.collapsed)}


def role(path: str) -> str:
    """A module path with its layer indices as ``*``: ``bert.encoder.layer.3.output.dense`` ->
    ``bert.encoder.layer.*.output.dense`` (an ``fnmatch`` pattern matching every layer's copy)."""
    return _INDEX.sub("*", path)


def keep_label(keep: Sequence[str]) -> str:
    """A keep-list as people read it: single-layer module paths of one role written once, their layer indices as
    ranges in numeric order; the exact list stays in ``FP8Plan.keep`` / ``PassSpec.fp8_keep`` / ``fp8_keep``.

    ``("h.*.attn.c_proj", "h.0.mlp.c_fc", "h.1.mlp.c_fc", "h.2.mlp.c_fc", "h.10.mlp.c_fc", "h.3.attn.c_attn")`` ->
    ``"h.*.attn.c_proj, h.{0-2,10}.mlp.c_fc, h.3.attn.c_attn"``. Lossless: expanding each ``{…}`` (``a-b`` every
    index from a to b, ``a,b`` each) gives the same set of entries back. The rules:

    - a single-layer path (no ``fnmatch`` character, dotted components of digits: the layer indices :func:`role`
      replaces) is grouped with the other paths of its role that share every index but the last, written at the
      position of the role's first path; a group of one index stays the plain path;
    - a path whose role is itself an entry (``h.*.mlp.c_fc`` with ``h.3.mlp.c_fc``: every layer's copy kept)
      is left out, the role pattern ``*`` says it already;
    - any other entry (a role or user pattern, a path without layer index, an index with a leading zero) is
      written as given, in its place; a repeated entry once.

    Args:
        keep: ``fnmatch`` patterns or module paths of the linears kept in bf16, in any order.

    Returns:
        The entries joined by ``", "``; ``""`` for an empty keep-list (callers say what that means).
    """
    entries = list(dict.fromkeys(keep))
    patterns = {k for k in entries if _GLOB.search(k)}
    slots: dict[tuple[str, str], dict[tuple[int, ...], list[int]] | None] = {}
    for k in entries:
        parts = k.split(".")
        idx = [i for i, c in enumerate(parts) if c.isascii() and c.isdigit()]
        if k in patterns or not idx or any(str(int(parts[i])) != parts[i] for i in idx):
            slots.setdefault(("as given", k), None)
            continue
        r = role(k)
        if r in patterns:
            continue
        fixed = tuple(int(parts[i]) for i in idx[:-1])
        slots.setdefault(("role", r), {}).setdefault(fixed, []).append(int(parts[idx[-1]]))
    out = []
    for (kind, k), groups in slots.items():
        if groups is None:
            out.append(k)
            continue
        parts = k.split(".")
        stars = [i for i, c in enumerate(parts) if c == "*"]
        for fixed in sorted(groups):
            for i, n in zip(stars, fixed):
                parts[i] = str(n)
            last = sorted(set(groups[fixed]))
            parts[stars[-1]] = str(last[0]) if len(last) == 1 else "{" + _ranges(last) + "}"
            out.append(".".join(parts))
    return ", ".join(out)


def _ranges(ns: list[int]) -> str:
    """Sorted distinct integers as runs: ``[0, 1, 2, 3, 5, 6, 9]`` -> ``"0-3,5,6,9"`` (a run of two: ``a,b``)."""
    runs: list[list[int]] = []
    for n in ns:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a},{b}" if b == a + 1 else f"{a}-{b}" for a, b in runs)


def kept_roles(keep: Sequence[str]) -> frozenset[str]:
    """The roles a keep-list keeps in bf16, wholly or in part: each entry's :func:`role` (a single layer's path
    ``bert.encoder.layer.4.attention.self.query`` counts as its role ``bert.encoder.layer.*.attention.self.query``,
    a role pattern as itself)."""
    return frozenset(role(k) for k in keep)


def linear_roles(gm: fx.GraphModule) -> dict[str, float]:
    """FLOPs per role of the FP8-eligible linears of ``gm`` (an ATen graph before ``cast_fp8_linears``): the
    FLOPs of :func:`linear_layers` summed per :func:`role`."""
    roles: dict[str, float] = {}
    for path, flops in linear_layers(gm).items():
        roles[role(path)] = roles.get(role(path), 0.0) + flops
    return roles


def linear_layers(gm: fx.GraphModule) -> dict[str, float]:
    """FLOPs per source module path (``bert.encoder.layer.3.output.dense``; the node's name when it has no
    source module) of the FP8-eligible linears of ``gm`` (an ATen graph before ``cast_fp8_linears``).

    Eligible by their weight as ``cast_fp8_linears`` sees it (``passes.fp8_numerics.weight_ineligible``: a 2-D
    ``get_attr`` floating weight, K and N multiples of 16). FLOPs are ``2 * rows * K * N`` with the rows of the
    input's ``meta["val"]`` (symbolic sizes count as their hint); only their ratios matter.
    """
    from passes.calibrate import source_module
    from passes.fp8_numerics import gemm_nk, weight_gemm, weight_ineligible

    layers: dict[str, float] = {}
    for node in gm.graph.nodes:
        gemm = weight_gemm(node)
        if gemm is None or weight_ineligible(gm, gemm) is not None:
            continue
        n, k = gemm_nk(gm, gemm)
        x = gemm.x.meta.get("val") if isinstance(gemm.x, fx.Node) else None
        rows = 1
        if isinstance(x, torch.Tensor):
            for s in x.shape[:-1]:
                rows *= _hint(s)
        key = source_module(node) or node.name
        layers[key] = layers.get(key, 0.0) + 2.0 * rows * k * n
    return layers


def _hint(size: Any) -> int:
    if isinstance(size, int):
        return size
    try:
        return int(size.node.hint) if size.node.hint is not None else 1
    except AttributeError:
        return 1


def plan_fp8_keep(roles: dict[str, float], error_of: Callable[[tuple[str, ...]], float], max_error: float,
                  margin: float = DEFAULT_MARGIN, *, layers: dict[str, float] | None = None,
                  metric: str = METRIC_L2) -> FP8Plan:
    """Greedy FP8 keep-list: the fewest FLOPs kept in bf16 for an error under ``margin * max_error``.

    Args:
        roles: pattern -> FLOPs (:func:`linear_roles`).
        error_of: the measured error of the FP8 graph with a keep-list (relative L2 against FP32, or the score
            shortfall: ``metric``); NaN counts as over the aim.
        max_error: the FP8 error limit (``--max-error-fp8``, or the allowed score shortfall).
        margin: fraction of ``max_error`` to aim at, in (0, 1].
        layers: module path -> FLOPs of every eligible linear (:func:`linear_layers`); when given, kept roles are
            refined layer by layer (step 6 of the module docstring) and FLOP shares count layers.
        metric: what ``error_of`` measures (:data:`METRIC_L2` or :data:`METRIC_SCORE`), for the plan's texts.

    Returns:
        The plan; ``reason`` set when no role can run FP8 within the aim (every role kept), or when the
        graph has no eligible linear.

    Raises:
        ValueError: ``margin`` outside (0, 1] or ``max_error`` not positive.
    """
    if not 0 < margin <= 1:
        raise ValueError(f"margin must be in (0, 1], got {margin}")
    if not max_error > 0:
        raise ValueError(f"max_error must be positive, got {max_error}")
    target = margin * max_error
    total = sum(roles.values())
    if not roles or total <= 0:
        return FP8Plan((), math.nan, target, 0.0, dict(roles), [],
                       reason="no linear is FP8-eligible (2-D weight, K and N multiples of 16)", metric=metric)
    units = dict(layers) if layers else dict(roles)

    def share_of(keep) -> float:  # FP8 FLOP share, over layers when they are known
        return _share_of(units, keep)

    error_of = _once(error_of)
    keep: list[str] = []
    err = error_of(())
    steps = [{"keep": [], "error": err}]
    while not err <= target:  # NaN counts as over
        left = [r for r in roles if r not in keep]
        if len(left) == 1:  # keeping the last one means no FP8 at all
            keep.append(left[0])
            break
        best: tuple[float, str, float] | None = None
        for r in left:
            e = error_of(tuple(keep + [r]))
            steps.append({"keep": keep + [r], "error": e})
            gain = (err - e) if math.isfinite(e) and math.isfinite(err) else (math.inf if math.isfinite(e) else -math.inf)
            score = gain / roles[r]
            if best is None or score > best[0]:
                best = (score, r, e)
        keep.append(best[1])
        err = best[2]
    # The greedy path is not the only candidate: of every keep-list measured on the way, start from the one under
    # the aim with the most FP8 FLOPs (GPT-2 on the CPU: the greedy ended at the two attention roles in FP8, 23 % of
    # the FLOPs, while keeping everything but the LM head, measured in its last round, was under the aim with 31 %).
    best = max((s for s in steps if s["error"] <= target),
               key=lambda s: (share_of(s["keep"]), -s["error"]), default=None)
    if best is not None and share_of(best["keep"]) > share_of(keep):
        keep, err = list(best["keep"]), best["error"]
        steps.append({"keep": list(keep), "error": err, "picked": "most FP8 FLOPs of the measured keep-lists"})
    if err <= target and len(keep) > 1:  # release what the last steps kept without need, largest FLOPs first
        for r in sorted(keep, key=lambda r: -roles[r]):
            if len(keep) == 1:  # releasing the last one is the all-FP8 graph, measured first
                break
            trial = tuple(k for k in keep if k != r)
            e = error_of(trial)
            steps.append({"keep": list(trial), "error": e, "release": r})
            if e <= target:
                keep, err = list(trial), e
    if layers and (err <= target or share_of(keep) == 0):
        keep, err = _release_layers(roles, layers, keep, err, target, error_of, steps)
    share = share_of(keep)
    reason = None
    if share == 0:
        limit = (f"--max-error-fp8 {max_error:g}" if metric == METRIC_L2 else
                 f"the score limit (shortfall {max_error:.3g} from FP32)")
        reason = (f"FP8 cannot meet {limit} on this model: with every linear in FP8 the {metric} "
                  f"is {steps[0]['error']:.2e}, and keeping all but one linear group in bf16 still gave "
                  f"{min((s['error'] for s in steps if len(s['keep']) == len(roles) - 1), default=math.nan):.2e} (aim "
                  f"{target:.2e}); FP8 candidates are rejected")
    alternatives, collapsed = _collapse(_alternatives(units, steps, target, keep, err)) if reason is None else ([], [])
    return FP8Plan(tuple(keep), err, target, share, dict(roles), steps, reason, alternatives=alternatives,
                   metric=metric, collapsed=collapsed)


def _once(error_of: Callable[[tuple[str, ...]], float]) -> Callable[[tuple[str, ...]], float]:
    """``error_of`` measuring each keep-list once: a keep-list met again (in any order: the patterns are a set)
    returns its first measurement. The release step (4.) meets the greedy's own lists again: releasing the role
    kept last gives the list of the round before, releasing the one kept before it a list tried in the last
    round (2 of BERT-base's 13 role-level graphs in the run of benchmarks/NOTES.md, "`tctune optimize` with every
    default on the recipes"). Its step is still recorded."""
    seen: dict[tuple[str, ...], float] = {}

    def once(keep: tuple[str, ...]) -> float:
        key = tuple(sorted(keep))
        if key not in seen:
            seen[key] = error_of(keep)
        return seen[key]
    return once


def _release_layers(roles: dict[str, float], layers: dict[str, float], keep: list[str], err: float, target: float,
                    error_of: Callable[[tuple[str, ...]], float], steps: list[dict]) -> tuple[list[str], float]:
    """Step 6: each kept role with several layers, largest FLOPs first, is replaced by the exact paths of its
    layers, and each layer (largest FLOPs first) is tried back in FP8 and released while the error stays under
    ``target``; at most ``MAX_LAYER_RELEASES`` graphs. Returns the new keep-list and its error."""
    budget = MAX_LAYER_RELEASES
    for r in sorted(keep, key=lambda r: -roles.get(r, 0.0)):
        paths = sorted((p for p in layers if fnmatchcase(p, r)), key=lambda p: (-layers[p], p))
        if len(paths) < 2 or r not in keep:
            continue  # one layer: releasing it is the role-level release, already measured
        kept = list(paths)
        others = [k for k in keep if k != r]
        for p in paths:
            if budget <= 0 or len(kept) == 1:  # the last layer out is the whole role, measured before
                break
            budget -= 1
            trial = others + [q for q in kept if q != p]
            e = error_of(tuple(trial))
            steps.append({"keep": list(trial), "error": e, "release_layer": p})
            if e <= target:
                kept.remove(p)
                err = e
        if len(kept) < len(paths):
            keep = others + kept
    return keep, err


def _alternatives(roles: dict[str, float], steps: list[dict], target: float, keep: list[str], err: float) -> list[dict]:
    """The distinct measured keep-lists under ``target`` that run some FP8, most FP8 FLOPs first (lower error on
    ties), at most ``MAX_ALTERNATIVES``, always including the plan's choice ``keep``."""
    def entry(k, e):
        return {"keep": list(k), "error": e, "fp8_flop_share": _share(roles, k)}

    seen: dict[tuple, dict] = {}
    for s in steps:
        key = tuple(sorted(s["keep"]))
        if s["error"] <= target and _share(roles, key) > 0 and key not in seen:
            seen[key] = entry(s["keep"], s["error"])
    ranked = sorted(seen.values(), key=lambda a: (-a["fp8_flop_share"], a["error"]))[:MAX_ALTERNATIVES]
    if _share(roles, keep) > 0 and tuple(sorted(keep)) not in {tuple(sorted(a["keep"])) for a in ranked}:
        ranked = [entry(keep, err), *ranked][:MAX_ALTERNATIVES]
    return ranked


def choose_fastest(plan: FP8Plan, throughput_of: Callable[[tuple[str, ...]], float | None]) -> FP8Plan:
    """Time the plan's alternatives and keep the fastest: FP8 FLOPs are a poor proxy for speed.

    On the H200 (BERT-base, batch 64, Inductor + CUDA graph), two keep-lists with the same 33 % of the FLOPs in
    FP8 ran 20,088 seq/s (FP8 on the fused QKV and attention-output projections, whose input quantization fuses
    into the LayerNorm before them) and 17,064 seq/s (FP8 on the FFN-down projection: N = 768 and a 3072-wide
    activation to quantize after the GELU), the bf16 graph 19,816 (benchmarks/NOTES.md, "what `tctune optimize`
    itself chooses"). So keep-lists that keep different roles are all timed.

    Keep-lists that keep the same roles (:func:`kept_roles`; they differ only in which single layers of those
    roles stay bf16) are timed once, as the one with the most FP8 FLOPs (lower error on ties), a measured rule:
    on the H200 (BERT-base, batch 128, Inductor + CUDA graph), three such lists with 37.5 %, 35.4 % and 33.3 %
    of the FLOPs in FP8 (layer 4's fused QKV projection in FP8 or bf16, or every layer's in bf16) ran 17,807,
    17,740 and 17,720 items/s, within 0.5 %, at about 20 s of compile and timing each (benchmarks/NOTES.md,
    "`tctune optimize` with every default on the recipes"). With one set of roles nothing is timed.

    Args:
        plan: a usable plan with ``alternatives`` (those of one set of roles are collapsed here if they are not
            yet: ``FP8Plan.collapsed``).
        throughput_of: the measured throughput (items/s) of the FP8 graph with a keep-list, None when it failed;
            called once per alternative left after the collapse, not at all when one is left.

    Returns:
        The plan with ``keep`` / ``error`` / ``fp8_flop_share`` of the fastest alternative and ``speeds`` filled;
        with one alternative left after a collapse, that one (not timed); unchanged when there was at most one
        alternative or none ran.
    """
    if not plan.usable:
        return plan
    alternatives, collapsed = _collapse(plan.alternatives)
    if collapsed:
        plan.alternatives, plan.collapsed = alternatives, [*plan.collapsed, *collapsed]
    if len(plan.alternatives) == 1 and plan.collapsed:  # one set of roles: its most FP8, untimed
        best = plan.alternatives[0]
        plan.keep, plan.error, plan.fp8_flop_share = tuple(best["keep"]), best["error"], best["fp8_flop_share"]
    if len(plan.alternatives) < 2:
        return plan
    speeds = [throughput_of(tuple(a["keep"])) for a in plan.alternatives]
    plan.speeds = speeds
    ran = [(v, i) for i, v in enumerate(speeds) if v]
    if not ran:  # none could be timed: the error plan's own choice stands (the summary says they failed)
        return plan
    best = plan.alternatives[max(ran)[1]]
    plan.keep, plan.error, plan.fp8_flop_share = tuple(best["keep"]), best["error"], best["fp8_flop_share"]
    return plan


def _collapse(alternatives: list[dict]) -> tuple[list[dict], list[dict]]:
    """``alternatives`` split into one per set of :func:`kept_roles`, the one with the most FP8 FLOPs (lower
    error on ties; in their order), and the others, each with ``"into"`` (the keep-list it collapses into) and
    ``"why"`` (:data:`SAME_ROLES`)."""
    best: dict[frozenset, dict] = {}
    for a in alternatives:
        group = kept_roles(a["keep"])
        b = best.get(group)
        if b is None or (a["fp8_flop_share"], -a["error"]) > (b["fp8_flop_share"], -b["error"]):
            best[group] = a
    kept = [a for a in alternatives if best[kept_roles(a["keep"])] is a]
    collapsed = [{**a, "into": list(best[kept_roles(a["keep"])]["keep"]), "why": SAME_ROLES}
                 for a in alternatives if best[kept_roles(a["keep"])] is not a]
    return kept, collapsed


def _share(roles: dict[str, float], keep) -> float:
    """Fraction of the eligible linear FLOPs that run FP8 with ``keep`` in bf16."""
    return _share_of(roles, keep)


def _share_of(units: dict[str, float], keep) -> float:
    """Fraction of the FLOPs of ``units`` (roles or layer paths -> FLOPs) that no pattern of ``keep`` matches
    (``fnmatch``, as ``PassSpec.fp8_keep`` matches module paths; a role matches itself)."""
    return sum(v for u, v in units.items() if not any(u == k or fnmatchcase(u, k) for k in keep)) / sum(units.values())


@dataclass
class FastAccumCheck:
    """Whether a study's FP8 candidates use ``torch._scaled_mm``'s fast accumulation, and why (step 8.).

    Attributes:
        kept: True when the FP8 candidates are built with ``use_fast_accum=True``.
        keep: the FP8 keep-list the check was made with.
        error: the error of the FP8 graph with fast accumulation (``metric``), None when it could not run.
        error_full: the same graph's error with full-precision accumulation when known, else None.
        target: the aim both were held to (the FP8 plan's, ``margin * limit``).
        metric: :data:`METRIC_L2` or :data:`METRIC_SCORE`.
        speeds: measured throughput (items/s) ``{"full": .., "fast": ..}`` (None: failed), empty when not timed.
        reason: one line: what was measured and the decision.
        reused_from / policy: as ``FP8Plan`` (one check per study, reused by the other cast policies).
    """

    kept: bool
    keep: tuple[str, ...]
    error: float | None
    target: float
    reason: str
    error_full: float | None = None
    metric: str = METRIC_L2
    speeds: dict = field(default_factory=dict)
    reused_from: str | None = None
    policy: str | None = None

    def reused(self, policy: str) -> "FastAccumCheck":
        """This decision for another cast policy's FP8 graphs (the accumulation is the GEMMs', whatever the
        policy does around them; each trial's own accuracy check still decides)."""
        return replace(self, reused_from=self.policy or "another", policy=policy)

    def summary(self) -> str:
        """One line for the report and the log."""
        where = f"; checked under the {self.reused_from} policy and reused" if self.reused_from else ""
        return f"fast accumulation {'on' if self.kept else 'off'}: {self.reason}{where}"

    def to_dict(self) -> dict:
        return {"summary": self.summary(), "kept": self.kept, "keep": list(self.keep), "error": self.error,
                "error_full": self.error_full, "target": self.target, "metric": self.metric,
                "speeds": dict(self.speeds), "reused_from": self.reused_from}


def choose_fast_accum(keep: Sequence[str], target: float, error_fast: Callable[[], float],
                      throughput_of: Callable[[bool], float | None], *, error_full: float | None = None,
                      speed_full: float | None = None, metric: str = METRIC_L2,
                      min_gain: float = FAST_ACCUM_MIN_GAIN) -> FastAccumCheck:
    """Decide fast accumulation for the FP8 graph with keep-list ``keep``: kept when its error is within
    ``target`` (the accuracy contract's aim, as for the keep-list) and it runs at least ``min_gain`` faster.

    Args:
        keep: the chosen FP8 keep-list (recorded in the result).
        target: the error the FP8 plan aims at (``margin * limit``; relative L2 or score shortfall).
        error_fast: measures the error of the graph with fast accumulation (NaN/inf count as over the aim); an
            exception it raises rejects fast accumulation with its first line.
        throughput_of: ``throughput_of(fast_accum)`` -> items/s of the graph through the search's fastest runtime,
            None when it failed; called with True, and with False unless ``speed_full`` is given.
        error_full: the full-accumulation graph's error when already measured (for the record only).
        speed_full: its throughput when already timed (the plan's alternatives), so it is not compiled again.
        metric: what the errors are (:data:`METRIC_L2` or :data:`METRIC_SCORE`).
        min_gain: the least gain (fraction) that keeps it, :data:`FAST_ACCUM_MIN_GAIN`.

    Returns:
        A :class:`FastAccumCheck`; nothing is timed when the error is over the aim.
    """
    keep = tuple(keep)
    what = "error" if metric == METRIC_L2 else "score shortfall"
    try:
        err = error_fast()
    except Exception as exc:  # noqa: BLE001 - a graph that cannot run keeps full accumulation
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return FastAccumCheck(False, keep, None, target, f"its FP8 graph failed to run ({first})",
                              error_full, metric)
    full = f" (full accumulation: {error_full:.2e})" if error_full is not None else ""
    if not err <= target:
        return FastAccumCheck(False, keep, err, target, f"{what} {err:.2e}{full} is over the aim {target:.2e}",
                              error_full, metric)
    full_speed = speed_full if speed_full else throughput_of(False)
    fast_speed = throughput_of(True)
    speeds = {"full": full_speed, "fast": fast_speed}
    within = f"{what} {err:.2e}{full}, aim {target:.2e}"
    if not fast_speed or not full_speed:
        failed = "with" if not fast_speed else "without"
        return FastAccumCheck(False, keep, err, target, f"{within}; the graph {failed} it could not be timed",
                              error_full, metric, speeds)
    ratio = fast_speed / full_speed
    timed = f"{fast_speed:,.0f} against {full_speed:,.0f} items/s ({ratio:.3f}x)"
    if ratio < 1 + min_gain:
        return FastAccumCheck(False, keep, err, target, f"{within}; {timed}, under the {min_gain:.0%} gain that "
                                                        "keeps it", error_full, metric, speeds)
    return FastAccumCheck(True, keep, err, target, f"{within}; {timed}", error_full, metric, speeds)


def graph_error(g: fx.GraphModule, inputs: tuple, ref: Any,
                score_of: Callable[[fx.GraphModule], float] | None = None) -> float:
    """The error of the FP8 graph ``g`` (on the inputs' device) on ``inputs`` against the FP32 outputs ``ref``: its
    relative L2 error (largest over outputs), or ``score_of(g)`` (a score shortfall) when given; ``math.inf``
    when an output on ``inputs`` is NaN/inf. Raises whatever the forward raises."""
    from .measure import compare, precision_mode

    with precision_mode("fp8"), torch.inference_mode():
        err = compare(g(*inputs), ref)
    if err.nonfinite:
        return math.inf
    return err.rel_l2_error if score_of is None else score_of(g)


def plan_graph(build: Callable[[tuple[str, ...], Sequence[str]], fx.GraphModule], inputs: tuple, ref: Any,
               max_error: float, *, device: torch.device | None = None, margin: float = DEFAULT_MARGIN,
               score_of: Callable[[tuple[str, ...], fx.GraphModule], float] | None = None,
               per_layer: bool = True) -> FP8Plan:
    """:func:`plan_fp8_keep` for a captured graph: roles (and layers) from the graph after the passes that run
    before ``cast_fp8_linears`` (so a fused QKV is one role), errors from FP8 graphs run on ``inputs`` against
    ``ref``: their relative L2 error, or with ``score_of`` the score shortfall.

    Args:
        build: ``build(keep, names)`` -> the FP8 graph of the captured model with keep-list ``keep`` after the passes
            ``names`` (a fresh graph each call; the caller decides hardware and policy, e.g.
            ``tctune.trial.apply_passes``).
        inputs: the calibration inputs (on ``device``); ref: the FP32 model's outputs for them.
        max_error: the FP8 error limit; margin: see :func:`plan_fp8_keep`.
        device: where the graphs run (default: the first graph's buffers' device, else the CPU). NaN/inf outputs
            on ``inputs`` count as an infinite error (in both metrics).
        score_of: ``score_of(keep, graph)`` -> the score shortfall of the FP8 graph (on ``device``) with ``keep``
            (e.g. ``ScoreGate.shortfall`` of the user's score); then ``max_error`` is the allowed shortfall and the
            plan's ``metric`` is :data:`METRIC_SCORE`. None: relative L2 error.
        per_layer: refine kept roles layer by layer (step 6 of the module docstring).

    Raises:
        Whatever ``build`` raises (e.g. ``tctune.errors.PassError``); any exception of the FP8 graph's forward.
    """
    from passes import PIPELINE

    from .measure import release_memory

    before = PIPELINE[:PIPELINE.index("cast_fp8_linears")]
    base = build((), before)
    device = device or next((t.device for t in base.buffers()), torch.device("cpu"))
    layers = linear_layers(base)
    roles = linear_roles(base)
    del base

    def error_of(keep: tuple[str, ...]) -> float:
        g = build(keep, PIPELINE).to(device)
        try:
            scored = None if score_of is None else (lambda graph: score_of(tuple(keep), graph))
            return graph_error(g, inputs, ref, scored)
        finally:
            g = None
            release_memory(device)

    return plan_fp8_keep(roles, error_of, max_error, margin, layers=layers if per_layer else None,
                         metric=METRIC_L2 if score_of is None else METRIC_SCORE)


__all__ = ["DEFAULT_MARGIN", "FAST_ACCUM_MIN_GAIN", "FP8Plan", "FastAccumCheck", "choose_fast_accum", "graph_error",
           "MAX_ALTERNATIVES", "MAX_LAYER_RELEASES", "METRIC_L2", "METRIC_SCORE",
           "SAME_ROLES", "choose_fastest", "keep_label", "kept_roles", "linear_layers", "linear_roles", "plan_fp8_keep", "plan_graph",
           "role"]
