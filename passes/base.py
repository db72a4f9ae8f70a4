"""Shared types for tctune's graph passes.

Every pass is a function ``(gm: torch.fx.GraphModule, spec: PassSpec) -> PassResult``. Passes import torch
only (never ``tctune``), so they run and are tested on the CPU: ``spec`` carries plain facts (alignment in
elements per dtype, target dtype, keep-list) rather than a GPU handle.

Modelled on ``torch/fx/passes/infra/pass_base.py``: a result says whether the graph changed, extended with a
rewrite count, the rewritten node names, and ``skipped`` entries that say why a candidate node was left alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Ops kept in FP32 by the precision pass (numerically fragile: softmax, norms' statistics, reductions,
#: losses, exp/log). Names are ATen overload packets as they appear in ``torch.export`` graphs.
DEFAULT_KEEP_LIST: frozenset[str] = frozenset(
    {
        "softmax", "_softmax", "log_softmax", "_log_softmax",
        "layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
        "batch_norm", "_native_batch_norm_legit_no_training", "native_batch_norm", "instance_norm",
        "rms_norm", "_fused_rms_norm",
        "sum", "mean", "var", "std", "var_mean", "norm", "linalg_vector_norm", "cumsum", "prod", "logsumexp",
        "exp", "log", "log1p", "expm1", "pow", "rsqrt", "reciprocal",
        "cross_entropy_loss", "nll_loss", "nll_loss_nd", "mse_loss", "binary_cross_entropy_with_logits",
        "kl_div", "smooth_l1_loss", "l1_loss",
    }
)

#: Stored dtype per precision. fp8 stores bf16: only eligible linears compute in float8_e4m3fn
#: (``passes.cast_fp8.cast_fp8_linears``); every other op runs in bf16.
_DTYPES = {
    "fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
    "fp8": torch.bfloat16,
}
#: The precisions a ``PassSpec`` (and so tctune's search and export) takes.
PRECISIONS = tuple(_DTYPES)
#: FP8 scaling granularities (``PassSpec.fp8_scaling``).
FP8_SCALINGS = ("row", "tensor")


class PassFailure(RuntimeError):
    """A pass hit a graph it could not rewrite safely (raised with the pass name and node)."""


@dataclass(frozen=True)
class Skip:
    """A node a pass looked at and left alone. ``node`` is the FX node name, ``reason`` one line of why."""

    node: str
    reason: str

    def to_dict(self) -> dict:
        return {"node": self.node, "reason": self.reason}


@dataclass
class PassResult:
    """What one pass did to a graph.

    Attributes:
        name: the pass's name (its function name, verb_object).
        graph_module: the (possibly rewritten, in place) graph module.
        count: number of rewrites made.
        changed: names of the nodes rewritten (or created), for the report.
        skipped: candidate nodes left alone, each with its reason.
        notes: free-form facts worth reporting (e.g. ``{"padded": {"fc": [10, 16]}}``).
    """

    name: str
    graph_module: torch.fx.GraphModule
    count: int = 0
    changed: list[str] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    notes: dict = field(default_factory=dict)

    @property
    def modified(self) -> bool:
        return self.count > 0

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "changed": self.count,
            "changed_nodes": list(self.changed),
            "skipped": [s.to_dict() for s in self.skipped],
            "notes": self.notes,
        }


@dataclass(frozen=True)
class PassSpec:
    """Plain facts a pass needs about the target, with no GPU handle.

    Attributes:
        precision: one of ``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"``, ``"fp8"`` (the compute precision of
            the candidate; ``"fp8"``: eligible linears in float8_e4m3fn, everything else bf16).
        alignment: Tensor Core alignment in *elements* per dtype name, e.g. ``{"fp16": 8, "bf16": 8, "tf32": 4,
            "fp8": 16}`` (NVIDIA "Matrix Multiplication Background User's Guide", Tensor Core requirements).
            A missing dtype, or 1, means "no alignment requirement" and padding passes skip.
        arch: architecture name for reports (``"Hopper"``, ``"cpu"``, ...).
        keep_list: ATen op names kept in FP32 by the precision pass.
        training: True when the graph will be trained (eval-only folds are skipped).
        fp32_nodes: FX node names whose values overflow the low dtype (``passes.calibrate.overflow_nodes``):
            the precision pass computes them, and every op reading them, in FP32.
        overflow_margin: the head-room factor ``fp32_nodes`` was chosen with (max |x| > limit / margin),
            quoted in the precision pass's skip reasons.
        residual_fp32: the precision pass keeps residual adds and embedding lookups in FP32, as autocast does
            (True, the accurate policy); False casts them too, as ``model.half()`` does (the fast policy).
        fp8_scaling: FP8 scale granularity at precision ``"fp8"``: ``"row"`` (per output channel for weights,
            per token for activations; the default) or ``"tensor"`` (one scale per tensor).
        fp8_keep: the FP8 keep-list: ``fnmatch`` patterns on a linear's source module path (``"*.output.dense"``)
            whose linears stay bf16 at precision ``"fp8"``, as TensorRT Model Optimizer's wildcard layer exclusion
            does. E4M3's 3 mantissa bits cost a relative rounding error of up to 2^-4 per operand: on BERT-base
            (random weights, 12 layers) every linear in FP8 gives 7.1e-2 relative L2 against FP32, keeping the
            residual-writing projections (``*.output.dense``: attention output and FFN down) in bf16 gives 5.0e-2,
            keeping the FFN (``*.intermediate.dense`` too) 3.7e-2 (benchmarks/NOTES.md, the "FP8 through
            Inductor" entry).
        pad_graph_outputs: ``pad_linear_dims`` pads the N of a linear whose output the graph returns (directly,
            or through views and dtype casts only) when True, the default of the eager / search path where
            padding is measured per candidate. False (what ``tctune.backend`` sets, Inductor being its
            runtime) leaves that N alone: the padded GEMM's output must then be sliced and copied whole into
            the returned tensor, and under Inductor that copy cost more than the aligned GEMM saved. Measured
            on the H200, bf16, full backend pipeline against the same pipeline without ``pad_linear_dims``,
            as a fraction of ``torch.compile(model.to(bf16))``'s throughput: PegasusForCausalLM 0.95 -> 0.99
            (its logits copy, ``triton_poi_fused__to_copy__unsafe_view_clone_slice``, took 4.8 ms beside the
            9.3 ms LM-head GEMM), AllenaiLongformerBase 0.83 -> 0.88, TrOCRForCausalLM 0.92 -> 0.93
            (benchmarks/results/zoo/2026-12-01-h200-ablate/, one JSON file per model).
        restore_output_dtypes: the precision pass casts every graph output back to its original dtype (True,
            the default: callers get the FP32 model's dtypes). False leaves each floating output in the dtype
            the rewritten graph computed it in (the low dtype, or FP32 where a keep-list / residual rule kept
            the producing op FP32), as ``model.half()`` and ``torch.autocast`` return them: no up-cast copy at
            the graph's end (an MT5 logits tensor of 250k classes took 6.8 ms to up-cast on the H200, bf16,
            ``tctune.backend`` against ``torch.compile(model.to(torch.bfloat16))``, benchmarks/NOTES.md).
            Outputs the original graph returned in a low or non-FP32 dtype are restored either way.
        fp8_fast_accum: at precision ``"fp8"``, ``cast_fp8_linears`` calls ``torch._scaled_mm`` with
            ``use_fast_accum=True``: the GEMM's intermediate sums are then not periodically promoted to higher
            precision, "faster but at the cost of lower accuracy" on some GPUs (cuBLAS documentation,
            ``CUBLASLT_MATMUL_DESC_FAST_ACCUM``; Hopper's FP8 Tensor Core accumulator keeps about 14 bits, DeepSeek-V3
            technical report, section 3.3.2). False (the default): full-precision accumulation. Ignored at other
            precisions.
    """

    precision: str = "fp32"
    alignment: dict = field(default_factory=dict)
    arch: str = "cpu"
    keep_list: frozenset = DEFAULT_KEEP_LIST
    training: bool = False
    fp32_nodes: frozenset = frozenset()
    overflow_margin: float = 2.0
    fp8_scaling: str = "row"
    residual_fp32: bool = True
    fp8_keep: tuple = ()
    pad_graph_outputs: bool = True
    restore_output_dtypes: bool = True
    fp8_fast_accum: bool = False

    def __post_init__(self) -> None:
        if self.precision not in _DTYPES:
            raise ValueError(f"precision must be one of {sorted(_DTYPES)}, got {self.precision!r}")
        if self.fp8_scaling not in FP8_SCALINGS:
            raise ValueError(f"fp8_scaling must be one of {list(FP8_SCALINGS)}, got {self.fp8_scaling!r}")
        if isinstance(self.fp8_keep, str) or not all(isinstance(p, str) and p for p in self.fp8_keep):
            raise ValueError(f"fp8_keep must be a tuple of non-empty module-path patterns, got {self.fp8_keep!r}")
        object.__setattr__(self, "fp8_keep", tuple(self.fp8_keep))
        if not isinstance(self.pad_graph_outputs, bool):
            raise ValueError(f"pad_graph_outputs must be True or False, got {self.pad_graph_outputs!r}")
        if not isinstance(self.restore_output_dtypes, bool):
            raise ValueError(f"restore_output_dtypes must be True or False, got {self.restore_output_dtypes!r}")
        if not isinstance(self.fp8_fast_accum, bool):
            raise ValueError(f"fp8_fast_accum must be True or False, got {self.fp8_fast_accum!r}")

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype tensors are stored in at this precision (tf32 stores fp32, fp8 bf16)."""
        return _DTYPES[self.precision]

    def align(self, precision: str | None = None) -> int:
        """Alignment in elements for ``precision`` (default: this spec's), 1 when there is no requirement."""
        return int(self.alignment.get(precision or self.precision, 1))
