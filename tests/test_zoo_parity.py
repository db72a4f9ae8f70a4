"""FP32 parity of tctune's graph rewrites on every zoo architecture (benchmarks/zoo.py), on the CPU.

The zoo's accuracy rule compares bf16 errors, and bf16 noise on random weights hides an FP32-level error of a
wrong rewrite: ``fuse_qkv`` fused Longformer's q/k/v projections although Longformer reads q and k through
``as_strided`` with strides fixed at capture, and its FP32 logits were off by 2.2e-2 while the bf16 rule
passed. Here each model goes through the tctune backend exactly as ``torch.compile(model, backend="tctune")``
takes it (Dynamo, graph breaks, the re-export, frozen weights) with every structural pass of the backend's
default pipeline planned for the H200 (``target="sm_90"``, precision bf16: padding to bf16's alignment, bf16's
padding rules) and the cast passes left out (``zoo.parity_options``), so the graph must compute what the FP32
model computes. Inductor's code generation is replaced by running the rewritten FX graph (a C++ compile per
model would take minutes on two cores; the GPU side is ``zoo.py --variants +tctune_fp32``).

Per model: built at the zoo's ``--tiny`` sizes (seeded weights) except the feed-forward width, 132 instead of
128 (:data:`FFN_WIDTH`): the tiny widths are all multiples of bf16's alignment of 8, so at 128 the padding
passes would have nothing to do; at 132 every feed-forward linear (GPT-2's Conv1D addmm too) is padded. It is
compiled on one seeded batch of fresh random
inputs (token ids uniform over the vocabulary, features N(0, 1), never zeros) and compared with FP32 eager on
that batch and on a second one, every output (``zoo.parity_error``: max |tctune - eager| / max |eager| per
floating output, other outputs exactly) within ``zoo.FP32_PARITY_TOL`` (1e-5), or, where FP32 eager is itself
further from a float64 run of the model, within ``zoo.FP32_ROUNDING_FACTOR`` (4) times that distance
(``zoo.parity_limit``: rounding of two FP32 evaluations, not a rewrite). A fallback (tctune's passes did not
run on a subgraph) fails the model with its reason.

Which models: :data:`FAMILIES`, one per Hugging Face architecture (the first entry of each config class, 36
models), and :data:`UNSEEN` (architectures outside the suite on which a CPU sweep found a bug, 1 model), run by
default: about 110 s of CPU time on two cores. The rest (:data:`OTHERS`: the other heads on
those architectures, and the TIMM / torchvision models, which the zoo builds at full size only) are marked
``slow`` and run only with ``TCTUNE_ZOO_PARITY_ALL=1``: the 19 other heads take about 40 s more, the 24 vision
models (timm and torchvision are not in the test extras) about 10 minutes. Models that cannot be built here
(timm / torchvision not installed, a class missing in this transformers) are skipped with the reason.
``test_structural_passes_fire_over_the_zoo`` prints the per-model table (model, passes fired, max relative
error) and asserts that the rewrites under test fired. ``fuse_epilogue`` fires here only for ReLU epilogues
(the tanh-GELU epilogue needs CUDA tensors); ``fuse_attention`` is not in the backend's default pipeline.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch

import tctune.backend as tb
from zoo import load_benchmark

TARGET = "sm_90"
DTYPE = "bf16"
BATCH = 2
#: Input seeds: the graph is compiled on the first batch's inputs, and compared with eager on every batch.
SEEDS = (1101, 1102)
ALL_ENV = "TCTUNE_ZOO_PARITY_ALL"
#: Feed-forward width of the parity models (``zoo.TINY``'s 128 + 4): 4 mod 8, so the padding passes fire.
FFN_WIDTH = 132
#: The ``zoo.TINY`` keys that are a config's feed-forward width.
FFN_KEYS = ("intermediate_size", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim", "d_inner", "ffn_dim",
            "hidden_dim")


zoo = load_benchmark("zoo")


def _families() -> tuple[list[str], list[str]]:
    """(the default set, the rest): per Hugging Face config class its first entry in the suite's order; the
    rest are the other heads on those architectures and the TIMM / torchvision models, which the zoo builds at
    full size only (no tiny configs: 6 to 180 s each on two CPU cores)."""
    first: list[str] = []
    rest: list[str] = []
    seen: set[str] = set()
    for name, entry in zoo.all_entries().items():
        if entry.suite != "huggingface":
            rest.append(name)
            continue
        config = zoo.hf_spec(name)[0]
        (rest if config in seen else first).append(name)
        seen.add(config)
    return first, rest


FAMILIES, OTHERS = _families()

#: Hugging Face architectures outside the dynamo suite (so not in benchmarks/zoo.py's lists), built like its
#: entries (``zoo.build_hf`` at ``--tiny`` sizes): name -> (config class, model class, config keyword arguments).
#: Each is here because the CPU sweep of architectures nobody had tested (benchmarks/NOTES.md, 2026-12-02,
#: eleventh session) found a bug on it that this FP32 check catches. Mamba: ``torch.vmap`` in its forward; the
#: passes' dead-code elimination dropped vmap's nesting calls, and the rewritten graph raised on every call.
UNSEEN: dict[str, tuple[str, str, dict]] = {
    "MambaForCausalLM": ("MambaConfig", "MambaForCausalLM", {}),
}


@dataclass
class Parity:
    """One model's parity run: ``status`` ok or skipped (``reason``), the rewrites per pass (``fired``), the
    worst ``max_rel_err`` over outputs and input batches, the first ``mismatch`` (structure, dtype, an integer
    output), the backend's ``fallbacks``, Dynamo ``subgraphs``, wall ``seconds``; above the fixed limit, FP32
    eager's own distance from float64 on the worst batch (``rounding``) and the ``limit`` it allows."""

    name: str
    status: str = "ok"
    reason: str = ""
    fired: dict = field(default_factory=dict)
    max_rel_err: float = 0.0
    mismatch: str | None = None
    fallbacks: list = field(default_factory=list)
    subgraphs: int = 0
    seconds: float = 0.0
    rounding: float | None = None
    limit: float = zoo.FP32_PARITY_TOL
    reports: list = field(default_factory=list)  # the backend's SubgraphReports (tb.reports empties on reset)


def _run_graph(gm, example_inputs, config_patches):
    """Stands in for Inductor (``tctune.backend.inductor_compile``): the rewritten graph, run as it is."""
    return gm.forward


@contextlib.contextmanager
def _eager_backend():
    """A fresh Dynamo and backend state, Inductor replaced by :func:`_run_graph` (no compile worker pool)."""
    with mock.patch.object(tb, "inductor_compile", _run_graph), torch._inductor.config.patch(compile_threads=1):
        torch._dynamo.reset()
        tb.reset()
        try:
            yield
        finally:
            torch._dynamo.reset()


def check_parity(model: torch.nn.Module, batches: list[tuple], name: str = "model") -> Parity:
    """Compile ``model`` through the tctune backend with ``zoo.parity_options`` on ``batches[0]`` and compare
    it with FP32 eager on every batch (``zoo.parity_error``). The model's own FP32 forward runs first."""
    res = Parity(name)
    t0 = time.perf_counter()
    with torch.no_grad(), _eager_backend():
        refs = [model(*b) for b in batches]
        compiled = torch.compile(model, backend=tb.backend(**zoo.parity_options(DTYPE, target=TARGET)))
        outs = [compiled(*b) for b in batches]
        reports = list(tb.reports)
    worst = 0
    for i, (out, ref) in enumerate(zip(outs, refs)):
        par = zoo.parity_error(out, ref)
        if par["max_rel_err"] > res.max_rel_err:
            res.max_rel_err, worst = par["max_rel_err"], i
        res.mismatch = res.mismatch or par["mismatch"]
    if res.mismatch is None and res.max_rel_err > zoo.FP32_PARITY_TOL:  # rounding, or a wrong rewrite?
        res.rounding = zoo.float64_distance(model, batches[worst], refs[worst])
        res.limit = zoo.parity_limit(res.rounding)
    res.reports = reports
    res.fired = zoo.fired_passes(reports)
    res.fallbacks = [r.fallback.splitlines()[0][:300] for r in reports if r.fallback]
    res.subgraphs = len(reports)
    res.seconds = time.perf_counter() - t0
    return res


def build_tiny(name: str):
    """Zoo entry (or :data:`UNSEEN` architecture) ``name`` built at ``--tiny`` sizes with the feed-forward width :data:`FFN_WIDTH`, seeded
    weights; returns ``(built, batches)``, one input tuple per seed of :data:`SEEDS`.

    Raises:
        zoo.NotBuildable: the reason it cannot be built here; the model's own errors propagate.
    """
    with mock.patch.dict(zoo.TINY, {k: FFN_WIDTH for k in FFN_KEYS}), mock.patch.dict(zoo.HF_SPECS, UNSEEN):
        torch.manual_seed(0)
        built = zoo.build_hf(name, tiny=True) if name in UNSEEN else zoo.build(zoo.all_entries()[name], tiny=True)
    return built, [built.make_inputs(BATCH, "cpu", seed) for seed in SEEDS]


@functools.lru_cache(maxsize=None)
def zoo_parity(name: str) -> Parity:
    """:func:`check_parity` of zoo entry ``name`` (:func:`build_tiny`; cached: the table test reuses it)."""
    try:
        built, batches = build_tiny(name)
        with torch.no_grad():
            built.model(*batches[0])
    except zoo.NotBuildable as exc:
        return Parity(name, status="skipped", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - the model itself cannot be built or run here: a skip with why
        return Parity(name, status="skipped", reason=f"cannot build or run tiny on the CPU: {zoo.one_line(exc)}")
    return check_parity(built.model, batches, name)


def _assert_parity(res: Parity) -> None:
    where = f"{res.name}: passes fired {res.fired}"
    assert not res.fallbacks, f"{where}; tctune fell back to plain Inductor (passes not checked): {res.fallbacks}"
    assert res.mismatch is None, f"{where}; {res.mismatch}"
    assert res.max_rel_err <= res.limit, (
        f"{where}; FP32 output differs from eager by {res.max_rel_err:.3g} of its scale (limit {res.limit:.3g}; "
        f"FP32 eager's own distance from float64: {res.rounding}): a rewrite changed what the graph computes")


def _params() -> list:
    slow = [pytest.mark.slow, pytest.mark.skipif(os.environ.get(ALL_ENV) != "1", reason=(
        f"another head on an architecture FAMILIES covers, or a full-size vision model; set {ALL_ENV}=1 to check "
        "every zoo model"))]
    return ([pytest.param(n, id=n) for n in FAMILIES + list(UNSEEN)]
            + [pytest.param(n, id=n, marks=slow) for n in OTHERS])


# ------------------------------------------------------------------------------------------------ the zoo


@pytest.mark.parametrize("name", _params())
def test_fp32_parity_on_zoo_model(name):
    pytest.importorskip("transformers")
    res = zoo_parity(name)
    if res.status == "skipped":
        pytest.skip(res.reason)
    _assert_parity(res)


def test_structural_passes_fire_over_the_zoo():
    """The check exercises the rewrites: over the default set, the QKV fusion, linear and matmul padding and the
    mask simplification fire, and nothing casts. Prints the per-model table."""
    pytest.importorskip("transformers")
    names = FAMILIES + list(UNSEEN) + (OTHERS if os.environ.get(ALL_ENV) == "1" else [])
    results = [zoo_parity(n) for n in names]
    lines = [f"{'model':<42} {'passes fired':<70} {'max rel err':>11} {'s':>5}"]
    for r in results:
        fired = ", ".join(f"{k} {v}" for k, v in r.fired.items()) or "none"
        if r.status == "skipped":
            lines.append(f"{r.name:<42} skipped: {r.reason[:100]}")
        else:
            lines.append(f"{r.name:<42} {fired:<70} {r.max_rel_err:>11.2e} {r.seconds:>5.1f}")
    print("\n" + "\n".join(lines))
    ran = [r for r in results if r.status == "ok"]
    assert ran, "no zoo model could be built here"
    total: dict[str, int] = {}
    for r in ran:
        for k, v in r.fired.items():
            total[k] = total.get(k, 0) + v
    assert set(total) <= set(zoo.structural_passes())  # nothing cast
    assert {"fuse_qkv", "pad_linear_dims", "pad_matmul_dims", "simplify_attention_mask"} <= set(total), total
    if any(r.name in OTHERS and zoo.all_entries()[r.name].suite != "huggingface" for r in ran):  # CNNs ran: BN folds, conv padding
        assert {"fold_conv_batchnorm", "pad_conv_channels"} <= set(total), total
    for r in ran:
        _assert_parity(r)


# ------------------------------------------------------------------------------------------------ it can fail


class StridedQK(torch.nn.Module):
    """q, k, v projections of one input; q and k read as overlapping chunks through ``as_strided`` with strides
    taken from each projection's own contiguous output, as Longformer's ``_chunk`` does. Returns the attention
    output and, as an integer output, its argmax over features."""

    def __init__(self, d: int = 16, window: int = 4) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.d, self.w = d, window

    def _chunk(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        n = s // self.w - 1
        return x.as_strided((b, n, 2 * self.w, d), (x.stride(0), self.w * x.stride(1), x.stride(1), x.stride(2)))

    def forward(self, x: torch.Tensor):
        q, k, v = self._chunk(self.q(x)), self._chunk(self.k(x)), self.v(x)
        scores = torch.einsum("bnid,bnjd->bnij", q, k).softmax(-1)
        out = torch.einsum("bnij,bnjd->bnid", scores, self._chunk(v.contiguous()))
        return out, out.argmax(-1)


def _strided_batches() -> tuple[torch.nn.Module, list[tuple]]:
    torch.manual_seed(0)
    model = StridedQK().eval()
    g = torch.Generator().manual_seed(7)
    return model, [(torch.randn(2, 16, 16, generator=g),) for _ in SEEDS]


def test_fuse_qkv_refuses_the_strided_reads_and_parity_holds():
    model, batches = _strided_batches()
    res = check_parity(model, batches, "StridedQK")
    _assert_parity(res)
    assert "fuse_qkv" not in res.fired
    skipped = [s.reason for rep in res.reports for r in rep.results if r.name == "fuse_qkv" for s in r.skipped]
    assert any("as_strided" in why for why in skipped), skipped


def test_parity_check_reports_a_fused_qkv_read_through_as_strided(monkeypatch):
    """The Longformer bug, re-introduced: with fuse_qkv's as_strided refusal turned off the q/k/v linears are
    fused, the chunks read other elements, and the check reports the mismatch."""
    monkeypatch.setattr(sys.modules["passes.fuse_qkv"], "_as_strided_reader", lambda node: None)
    model, batches = _strided_batches()
    res = check_parity(model, batches, "StridedQK")
    assert res.fired.get("fuse_qkv") == 1 and not res.fallbacks
    assert res.max_rel_err > 100 * zoo.FP32_PARITY_TOL or res.mismatch is not None
    with pytest.raises(AssertionError, match="a rewrite changed what the graph computes|elements differ"):
        _assert_parity(res)


def test_parity_check_reports_the_bug_on_the_tiny_longformer(monkeypatch):
    """The same on the zoo's own Longformer at --tiny sizes: 0 with the refusal, above the limit without."""
    pytest.importorskip("transformers")
    name = "AllenaiLongformerBase"
    fixed = zoo_parity(name)
    if fixed.status == "skipped":
        pytest.skip(fixed.reason)
    monkeypatch.setattr(sys.modules["passes.fuse_qkv"], "_as_strided_reader", lambda node: None)
    built, batches = build_tiny(name)
    broken = check_parity(built.model, batches, name)
    assert "fuse_qkv" not in fixed.fired and fixed.max_rel_err <= zoo.FP32_PARITY_TOL
    assert broken.fired.get("fuse_qkv", 0) >= 1
    assert broken.max_rel_err > 10 * zoo.FP32_PARITY_TOL, broken
    with pytest.raises(AssertionError, match="a rewrite changed what the graph computes"):
        _assert_parity(broken)  # FP32 eager's own rounding does not explain it either
    assert broken.limit < broken.max_rel_err


def test_parity_error_compares_every_output():
    ref = {"logits": torch.tensor([[1.0, -2.0], [4.0, 0.5]]), "ids": torch.tensor([3, 1]), "n": 2}
    same = {"logits": ref["logits"].clone(), "ids": ref["ids"].clone(), "n": 2}
    assert zoo.parity_error(same, ref) == {"max_rel_err": 0.0, "outputs": 3, "worst_output": 0, "mismatch": None}
    off = dict(same, logits=ref["logits"] + torch.tensor([[0.0, 0.0], [0.0, 4e-5]]))
    assert zoo.parity_error(off, ref)["max_rel_err"] == pytest.approx(1e-5, rel=1e-3)  # 4e-5 of the scale 4
    ids = dict(same, ids=torch.tensor([3, 2]))
    assert "1 of 2 torch.int64 elements differ" in zoo.parity_error(ids, ref)["mismatch"]
    assert zoo.parity_error(dict(same, n=3), ref)["max_rel_err"] == float("inf")
    half = dict(same, logits=ref["logits"].half())
    assert "float16" in zoo.parity_error(half, ref)["mismatch"]
    nan = dict(same, logits=ref["logits"].clone())
    nan["logits"][0, 0] = float("nan")
    assert "non-finite" in zoo.parity_error(nan, ref)["mismatch"]
    assert "structure" in zoo.parity_error((ref["logits"],), ref)["mismatch"]
    chunked = zoo.parity_error(off["logits"], ref["logits"], chunk=3)  # chunks that do not divide the size
    assert chunked["max_rel_err"] == pytest.approx(1e-5, rel=1e-3)
