"""Whether padding a GEMM / convolution dimension *pays*, kept apart from whether it is *legal*.

Why: the padding passes (``pad_linear_dims``, ``pad_conv_channels``) answer *can* a dimension be padded (the
result is provably the same); this module answers *should* it, from measurements, as Inductor's
``fx_passes/pad_mm.py`` separates its can-pad checks from its benchmark-gated should-pad decision. Here the
decision comes from a per-architecture table of measured facts rather than from benchmarking at compile time
(the passes run on the CPU): ``benchmarks/should_pad_h200.json``, whose numbers are the H200 reference
measurements in ``benchmarks/NOTES.md`` and which ``benchmarks/bench_padding.py`` re-measures. The rules are
data; this file only reads them.

Rules, in order, for one dimension ``d`` of op ``op`` at dtype ``dtype`` on architecture ``arch``, with the
Tensor Core alignment ``align`` (elements) of the pass spec:

1. ``align <= 1``: no requirement, no padding.
2. Vocabulary (GEMM ``N >= rules.vocab.min_n``, 32768 on Hopper): a multiple of ``rules.vocab.multiple``
   (64) when the evidence measurement at this dtype shows that multiple as fast as the alignment's
   (H200, bf16, LM head 16384x768: V=50304 2.06 ms vs V=50264 2.09 ms); otherwise the alignment.
3. Small convolution input channels (``conv2d`` ``Cin <= rules.conv_small_cin.max_cin``, 4 on Hopper) at a
   dtype the evidence covers (fp16): the fastest measured channel count, a multiple of 4 (7x7 NHWC stem
   conv Cin 3/4/8: 1.12/0.97/1.78 ms, so 3 would pad to 4, not 8) — unless the measurement also timed the
   padded graph *with its channel-pad op* (``ms_with_pad_op_by_Cin``) and that was no faster than unpadded:
   on the H200 padding a Cin 3 input to 4 in the graph took 2.44 ms against 1.10 ms, so it is not padded.
4. Otherwise the alignment (fp16 GEMM K=8191 vs 8192: 140 vs 646 TFLOP/s; 3x3 conv C=61 vs 64: 0.59 vs
   0.29 ms).
5. Tiny reduction dimensions (``K``, ``Cin``: the roles in ``max_inflation_roles``): if the chosen multiple
   grows ``d`` by more than ``max_inflation`` (1.5x), padding costs more than it saves and the answer is
   "can pad but should not" (threshold set between the stem conv's 3->4, 1.33x the work and faster, and
   3->8, 2.67x the work and slower than not padding). Padding a reduction dimension copies the activation
   into a wider tensor and multiplies the work by the same factor; padding ``N`` / ``Cout`` only widens the
   weight and the output (a slice view gives the original back), so a 10-class head still pads 10 -> 16.

Architectures missing from the table use its ``"default"`` section (alignment, tiny-dimension threshold, no
vocabulary or small-Cin rule), and the reason says there is no measurement.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Mapping, NamedTuple

#: The H200 table shipped with the repository (the reference measurements in ``benchmarks/NOTES.md``).
DEFAULT_TABLE_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "should_pad_h200.json"

_GEMM_OPS = frozenset({"linear", "mm", "addmm", "bmm", "matmul", "baddbmm"})
_CONV_OPS = frozenset({"conv2d", "convolution"})
#: Used when the table file is absent (e.g. an installed wheel without ``benchmarks/``).
_EMPTY_TABLE: dict = {"default": {"max_inflation": 1.5, "max_inflation_source": "built-in default",
                                  "measurements": [], "rules": {}}, "arch": {}}


class PadDecision(NamedTuple):
    """One should-pad answer; unpacks as ``(pad, multiple, reason)``.

    Attributes:
        pad: True when the dimension should be padded up to ``multiple``.
        multiple: the multiple (elements) the dimension is padded to, or would be.
        reason: one line with the rule and the measurement (and its source) behind it.
    """

    pad: bool
    multiple: int
    reason: str


@functools.lru_cache(maxsize=8)
def _load(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        return _EMPTY_TABLE
    with p.open() as f:
        return json.load(f)


def load_table(path: str | Path | None = None) -> dict:
    """The should-pad table at ``path`` (default ``benchmarks/should_pad_h200.json``), parsed once and cached.

    A missing file gives a built-in table with no measurements (alignment and tiny-dimension rules only).

    Raises:
        json.JSONDecodeError: the file exists but is not JSON.
    """
    return _load(str(path or DEFAULT_TABLE_PATH))


def arch_entry(arch: str, table: Mapping | None = None) -> tuple[dict, bool]:
    """``(entry, measured)``: the table section for ``arch`` (case-insensitive), or the default section."""
    table = table if table is not None else load_table()
    for name, entry in table.get("arch", {}).items():
        if name.lower() == str(arch).lower():
            return entry, True
    return table.get("default", _EMPTY_TABLE["default"]), False


def measurement(entry: Mapping, mid: str) -> dict | None:
    """The measurement with id ``mid`` in an architecture section, or None."""
    return next((m for m in entry.get("measurements", []) if m.get("id") == mid), None)


def should_pad(
    op: str,
    dims: Mapping[str, int],
    dtype: str,
    arch: str,
    align: int = 8,
    table: Mapping | None = None,
) -> PadDecision:
    """Decide whether one dimension of a GEMM or convolution should be padded, and to which multiple.

    Args:
        op: ATen op name: ``"linear"``, ``"mm"``, ``"addmm"``, ``"bmm"``, ``"matmul"`` or ``"conv2d"``.
        dims: exactly one ``{role: size}`` entry: the dimension decided, in elements. Roles: ``"N"``, ``"K"``
            for GEMMs (``M`` is never padded), ``"Cin"``, ``"Cout"`` for convolutions.
        dtype: compute precision name (``"fp16"``, ``"bf16"``, ``"tf32"``, ``"fp32"``).
        arch: architecture name as in ``PassSpec.arch`` (``"Hopper"``); unknown names use the default rules.
        align: the Tensor Core alignment in elements for ``dtype`` (``PassSpec.align()``).
        table: a parsed table (default: ``load_table()``).

    Returns:
        ``PadDecision(pad, multiple, reason)``. ``pad`` is False for an aligned dimension (``"already
        aligned"``), for ``align <= 1``, and for "can pad but should not" (the reason then starts so).

    Raises:
        ValueError: ``dims`` does not have exactly one entry, or ``op`` is not a GEMM or convolution.
    """
    if len(dims) != 1:
        raise ValueError(f"dims must have exactly one {{role: size}} entry, got {dict(dims)}")
    if op not in _GEMM_OPS and op not in _CONV_OPS:
        raise ValueError(f"should_pad knows GEMMs {sorted(_GEMM_OPS)} and convolutions {sorted(_CONV_OPS)}, not {op!r}")
    (role, size), = dims.items()
    size = int(size)
    if align <= 1:
        return PadDecision(False, 1, f"alignment 1 (no Tensor Core requirement for {dtype} on {arch})")
    entry, measured = arch_entry(arch, table)
    rules = entry.get("rules", {})
    where = f"{arch}" if measured else f"{arch} (no measurements: default rules)"

    multiple, why = align, _alignment_reason(op, rules, entry, align, where)
    vocab = rules.get("vocab")
    if op in _GEMM_OPS and role == "N" and vocab and size >= int(vocab["min_n"]):
        multiple, why = _vocab_rule(vocab, entry, dtype, align, where)
    small = rules.get("conv_small_cin")
    if op in _CONV_OPS and role == "Cin" and small and size <= int(small["max_cin"]):
        decided = _small_cin_rule(small, entry, dtype, size, where)
        if decided is not None:
            return decided
    if size % multiple == 0:
        return PadDecision(False, multiple, "already aligned")
    padded = -(-size // multiple) * multiple
    limit = float(entry.get("max_inflation", 1.5))
    if role in entry.get("max_inflation_roles", ("K", "Cin")) and padded / size > limit:
        return PadDecision(
            False,
            multiple,
            f"can pad but should not: {role} {size} -> {padded} is {padded / size:.2f}x the work "
            f"(limit {limit}x: {entry.get('max_inflation_source', 'default')})",
        )
    return PadDecision(True, multiple, f"{role} {size} -> {padded}: {why}")


def _alignment_reason(op: str, rules: Mapping, entry: Mapping, align: int, where: str) -> str:
    rule = rules.get("conv" if op in _CONV_OPS else "gemm")
    if not rule:
        return f"multiple of the alignment {align} on {where}"
    src = (measurement(entry, rule.get("evidence", "")) or {}).get("source", "")
    return f"multiple of the alignment {align} on {where} ({rule.get('summary', '')}; {src})"


def _vocab_rule(vocab: Mapping, entry: Mapping, dtype: str, align: int, where: str) -> tuple[int, str]:
    """Multiple for a vocabulary-sized N: ``vocab.multiple`` where the evidence shows it as fast as ``align``."""
    big = int(vocab["multiple"])
    ev = measurement(entry, vocab.get("evidence", "")) or {}
    times = {int(k): float(v) for k, v in ev.get("ms_by_N", {}).items()}
    if ev.get("dtype") != dtype or not times:
        return align, f"vocabulary N: no {dtype} measurement on {where}, multiple of the alignment {align}"
    base = min(times)
    at_big, at_align = -(-base // big) * big, -(-base // align) * align
    if at_big in times and at_align in times and times[at_big] <= times[at_align]:
        return big, (
            f"vocabulary N >= {vocab['min_n']}: multiple of {big} as fast as of {align} "
            f"(N={at_big} {times[at_big]} ms vs N={at_align} {times[at_align]} ms; {ev.get('source', '')})"
        )
    return align, f"vocabulary N: multiple of {big} not faster than of {align} on {where} ({ev.get('source', '')})"


def _small_cin_rule(small: Mapping, entry: Mapping, dtype: str, size: int, where: str) -> PadDecision | None:
    """Stem-conv input channels: the fastest measured channel count (None: rule does not cover ``dtype``)."""
    ev = measurement(entry, small.get("evidence", "")) or {}
    times = {int(k): float(v) for k, v in ev.get("ms_by_Cin", {}).items()}
    if ev.get("dtype") != dtype or not times:
        return None
    multiple = int(small["multiple"])
    best = min(times, key=times.get)
    shown = "/".join(str(c) for c in sorted(times)) + ": " + "/".join(f"{times[c]}" for c in sorted(times))
    src = f"{small.get('summary', shown)}; {ev.get('source', '')}"
    if best == min(times):  # the unpadded channel count was the fastest
        return PadDecision(False, multiple, f"can pad but should not: unpadded Cin fastest on {where} ({src})")
    if size % multiple == 0:
        return PadDecision(False, multiple, "already aligned")
    padded = -(-size // multiple) * multiple
    # A faster kernel for Cin 4 is no win if padding the input in the graph costs more than it saves.
    with_pad = {int(k): float(v) for k, v in ev.get("ms_with_pad_op_by_Cin", {}).items()}
    if size in times and padded in with_pad and with_pad[padded] >= times[size]:
        return PadDecision(False, multiple, (
            f"can pad but should not: Cin {size} -> {padded} with the channel pad itself took {with_pad[padded]} ms "
            f"vs {times[size]} ms unpadded on {where} ({ev.get('with_pad_op_source', src)})"))
    return PadDecision(True, multiple, f"Cin {size} -> {padded}: small-Cin rule on {where} ({src})")


__all__ = ["DEFAULT_TABLE_PATH", "PadDecision", "arch_entry", "load_table", "measurement", "should_pad"]
