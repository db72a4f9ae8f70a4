"""The options of one ``tctune optimize`` run (:class:`TuneConfig`), checked when built."""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, fields

from ..errors import UsageError

#: Study directions per objective: throughput (items/s), p99 latency (ms), peak memory (MiB).
OBJECTIVES = {"throughput": ("maximize",), "latency": ("minimize",), "pareto": ("maximize", "minimize", "minimize")}
#: ``TuneConfig.fp8_fast_accum`` values: ``auto`` (tried where it can help, kept when faster within the limit),
#: ``on`` (every FP8 candidate), ``off`` (none).
FP8_FAST_ACCUM_MODES = ("auto", "on", "off")
#: ``TuneConfig.autotune`` values: ``auto`` (the max-autotune finalist step runs on a CUDA GPU when the compile
#: budget allows, :func:`tctune.search.autotune.decide`), ``on`` (whenever there is a candidate to rebuild),
#: ``off`` (never).
AUTOTUNE_MODES = ("auto", "on", "off")
#: ``TuneConfig.min_score_ratio``'s default: MLPerf's "99 % of FP32" rule.
DEFAULT_MIN_SCORE_RATIO = 0.99
#: Numeric ``TuneConfig`` fields and the kind each must be (``int`` or any real ``float``; ``bool`` is neither).
NUMBER_FIELDS = {"trials": int, "seed": int, "effective_batch": int, "timeout_s": float, "max_error": float,
                 "max_error_fp8": float, "max_latency_ms": float, "max_memory_mib": float, "compile_budget_s": float,
                 "min_score_ratio": float, "min_score": float, "max_mismatch_rate": float}
#: The fields of :data:`NUMBER_FIELDS` that may be None (not set).
OPTIONAL_NUMBERS = ("effective_batch", "timeout_s", "max_latency_ms", "max_memory_mib", "min_score")


@dataclass(frozen=True)
class TuneConfig:
    """Options of one ``tctune optimize`` run (serialized into ``report.json``).

    Attributes:
        batch_sizes: batch sizes to search (items per call).
        trials: trials to add to the study in this run (≥ 1).
        timeout_s: stop starting new trials after this many seconds (None: no limit).
        max_error: largest relative L2 error against the FP32 reference a candidate may have, a fraction in
            (0, 1) (0.01 = 1 %); 1 or more raises ``UsageError`` (most likely a percentage: 2 meaning 0.02).
        max_error_fp8: the same for FP8 candidates (E4M3 keeps 3 mantissa bits; 5e-2 ≈ 26 dB SQNR), in (0, 1).
        target: ``--target`` name or ``sm_XX`` (plan for that GPU's alignment); None: the detected device.
        storage: Optuna storage URL; None: ``sqlite:///<out>/study.db``.
        seed: sampler seed, 0 to 2**32 - 1 (numpy's seed range).
        out_dir: output folder.
        export: build ONNX (and TensorRT where importable) for the best configuration.
        quiet: no progress bar.
        runtimes: execution backends to search (``eager``, ``cudagraphs``, ``inductor``,
            ``inductor-max-autotune``, ``inductor-cudagraphs``); None: all but max-autotune on a GPU (no CUDA
            graphs in train mode), ``eager`` on the CPU.
        compile_budget_s: an Inductor compile slower than this rejects its trial and stops further compiles.
        objective: ``throughput`` (items/s, maximized), ``latency`` (p99 ms per batch, minimized) or ``pareto``
            (throughput, p99 latency and peak memory together: the report lists the Pareto front).
        max_latency_ms, max_memory_mib: constraints (p99 ms per batch; peak CUDA MiB) like ``max_error``.
        mode: ``infer`` (forward passes) or ``train`` (forward, loss, backward, optimizer step).
        effective_batch: training only: samples per optimizer step, reached by gradient accumulation over
            micro-batches of the searched batch size (None: one micro-batch per step).
        devices: CUDA device indices; with more than one, one worker process per GPU shares the study.
        worker: this process is a worker started by ``devices`` (no export, no report).
        prune: stop clearly slower candidates early (Optuna's PercentilePruner); False measures every one fully.
        fp8_keep: FP8 keep-list (``fnmatch`` patterns of linears' module paths kept bf16 at precision fp8);
            None: planned from measured sensitivity (:mod:`tctune.fp8_plan`); ``()``: every eligible linear FP8.
        min_score_ratio: when the model file gives ``score(model)`` (higher is better), a candidate is infeasible
            when its score is below ``fp32 - (1 - min_score_ratio) * |fp32|`` (``min_score_ratio * fp32`` for a
            positive FP32 score); default 0.99, MLPerf's "99 % of FP32" accuracy target. In (0, 1].
        min_score: absolute alternative: the lowest score a candidate may have (replaces ``min_score_ratio``, which
            must then stay at its default: both given raise UsageError).
            When a score is given, it decides feasibility for every precision; ``max_error`` /
            ``max_error_fp8`` are reported but do not reject (NaN/inf and integer mismatches still do).
        max_mismatch_rate: largest fraction (0 to 1) of the elements of integer/bool outputs that may differ
            from FP32's (``tctune.measure.check_accuracy``); 0.0: they must match exactly.
        calibration: a folder of ``.safetensors`` / ``.npz`` input batches (:mod:`tctune.calibration`) used
            beside the seeded random inputs; None: the model file's ``calibration_inputs()`` when it has one.
        output_dtype: the output-dtype contract of every timed inference call, the same for tctune's candidates
            and the plain baselines (``tctune.trial.OUTPUT_DTYPES``). ``"compute"`` (default): floating outputs
            stay in the dtype the candidate computes them in, as a user running ``model.half()`` or
            ``torch.autocast`` gets them (tctune's graph inserts no up-cast at its outputs; the whole-model cast
            baseline returns its low-precision outputs). ``"fp32"``: every candidate returns the FP32 model's
            output dtypes, the up-cast copy timed inside the call (tctune's graph casts its outputs back; the
            autocast and whole-model cast baselines cast their fp16/bf16 outputs to FP32). Either way the error
            against the FP32 reference is computed in float64 after the timed calls. The tuned module
            (``tctune.optimize``) returns outputs under the same contract; exported engines keep FP32 outputs.
            Training steps (``mode="train"``) return no outputs to the caller and ignore it.
        fp8_fast_accum: ``torch._scaled_mm``'s fast accumulation for tctune's FP8 candidates
            (:data:`FP8_FAST_ACCUM_MODES`). ``"auto"`` (default): on Ada / Hopper, once the FP8 keep-list is chosen,
            the same FP8 graph with fast accumulation is checked against the FP8 accuracy limit (the plan's aim,
            0.9 × ``max_error_fp8`` or of the allowed score shortfall) and timed, and kept when faster
            (:func:`tctune.fp8_plan.choose_fast_accum`); ``"on"``: always; ``"off"``: never.
        autotune: the max-autotune finalist step (:data:`AUTOTUNE_MODES`, :mod:`tctune.search.autotune`): after
            the trials (inference), the best tctune candidate measured through ``inductor`` or
            ``inductor-cudagraphs`` is rebuilt through the runtime's max-autotune variant
            (``tctune.runtime.MAX_AUTOTUNE_VARIANT``) and measured as one more trial, which then competes like any
            other. ``"off"`` (default): never (measured on the H200: ResNet-50's max-autotune compile ran over 230 s
            against 4.6 s for its default compile, benchmarking Triton convolution templates per shape, with no
            measured gain yet; benchmarks/NOTES.md). ``"auto"``: on a CUDA GPU, when the candidate's own default-mode compile times
            ``tctune.search.autotune.AUTOTUNE_COMPILE_FACTOR`` (an estimate of the max-autotune compile) fits in
            ``compile_budget_s`` and in the time left before ``timeout_s``; ``"on"``: whenever such a candidate
            exists. Its compile is bounded by ``compile_budget_s`` like any other (checked when it ends). It needs
            ``inductor`` or ``inductor-cudagraphs`` in ``runtimes`` (the CPU's default is ``eager`` only); without
            one the search warns at its start (:func:`tctune.search.autotune.runtimes_note`).
    """

    out_dir: str
    batch_sizes: tuple[int, ...] = (8, 32, 128)
    trials: int = 16
    timeout_s: float | None = None
    max_error: float = 1e-2
    max_error_fp8: float = 5e-2
    target: str | None = None
    storage: str | None = None
    seed: int = 0
    export: bool = True
    quiet: bool = False
    runtimes: tuple[str, ...] | None = None
    compile_budget_s: float = 300.0
    objective: str = "throughput"
    mode: str = "infer"
    effective_batch: int | None = None
    devices: tuple[int, ...] | None = None
    worker: bool = False
    prune: bool = True
    max_latency_ms: float | None = None
    max_memory_mib: float | None = None
    fp8_keep: tuple[str, ...] | None = None
    min_score_ratio: float = DEFAULT_MIN_SCORE_RATIO
    min_score: float | None = None
    max_mismatch_rate: float = 0.0
    calibration: str | None = None
    output_dtype: str = "compute"
    fp8_fast_accum: str = "auto"
    autotune: str = "off"

    def __post_init__(self) -> None:
        """Raises UsageError naming the bad field (``err.field``, e.g. ``"trials"``) and what it must be."""
        from ..runtime import ALL_RUNTIMES

        def bad(field: str, message: str) -> UsageError:
            return UsageError(f"{field} {message}", field=field)

        for name, kind in NUMBER_FIELDS.items():  # first: the range checks below compare these with numbers
            v = getattr(self, name)
            if v is None and name in OPTIONAL_NUMBERS:
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Real if kind is float else numbers.Integral):
                raise bad(name, f"must be {'an integer' if kind is int else 'a number'}, got {v!r} "
                                f"({type(v).__name__})")
        if self.runtimes is not None:
            unknown = [r for r in self.runtimes if r not in ALL_RUNTIMES]
            if unknown or not self.runtimes:
                raise bad("runtimes", f"has unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(ALL_RUNTIMES)}")
        if self.mode not in ("infer", "train"):
            raise bad("mode", f"must be infer or train, got {self.mode!r}")
        if self.effective_batch is not None and (self.mode != "train" or self.effective_batch < 1):
            raise bad("effective_batch", "needs mode 'train' and a positive number of samples per optimizer step, "
                                         f"got {self.effective_batch!r} in mode {self.mode!r}\n  fix: "
                                         + ("add --mode train (gradient accumulation is a training setting)"
                                            if self.mode != "train" else "give a count of samples, e.g. 256"))
        if self.devices is not None and (not self.devices or len(set(self.devices)) != len(self.devices)
                                         or any(d < 0 for d in self.devices)):
            raise bad("devices", f"must be distinct GPU indices such as 0,1 — got {self.devices}")
        if self.objective not in OBJECTIVES:
            raise bad("objective", f"must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        for name, v in (("max_latency_ms", self.max_latency_ms), ("max_memory_mib", self.max_memory_mib)):
            if v is not None and v <= 0:
                raise bad(name, f"must be positive, got {v}")
        if self.compile_budget_s <= 0:
            raise bad("compile_budget_s", f"must be a positive number of seconds, got {self.compile_budget_s}")
        if not self.batch_sizes or any((not isinstance(b, int)) or b < 1 for b in self.batch_sizes):
            raise bad("batch_sizes", f"must be positive integers, got {self.batch_sizes!r}")
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise bad("batch_sizes", f"must be distinct, got {self.batch_sizes!r}")
        if self.trials < 1:
            raise bad("trials", f"must be at least 1, got {self.trials}")
        if not 0 <= self.seed < 2 ** 32:  # Optuna's samplers seed numpy, which takes 0 .. 2**32 - 1
            raise bad("seed", f"must be an integer from 0 to {2 ** 32 - 1}, got {self.seed}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise bad("timeout_s", f"must be a positive number of seconds, got {self.timeout_s}")
        for name in ("max_error", "max_error_fp8"):
            v = getattr(self, name)
            if not (v > 0):
                raise bad(name, f"must be positive, got {v}: it is the largest relative L2 error against the FP32 "
                                f"reference you accept, and any lower precision differs from FP32 a little\n"
                                f"  fix: give the error you accept as a fraction, e.g. 0.01 (1 %)")
            if v >= 1:  # a percentage typed as the fraction (2 meaning 2 %): 200 % lets any output through
                meant = f"did you mean {v / 100:g} ({v:g} %)?" if v < 100 else "e.g. 0.01 for 1 %"
                raise bad(name, f"must be below 1, got {v:g}: it is the largest relative L2 error against the FP32 "
                                f"reference, as a fraction (0.01 = 1 %); {meant}")
        if self.fp8_keep is not None and (isinstance(self.fp8_keep, str)
                                          or not all(isinstance(p, str) and p.strip() for p in self.fp8_keep)):
            raise bad("fp8_keep", f"must be None (planned), () or module-path patterns, got {self.fp8_keep!r}")
        if not (0 < self.min_score_ratio <= 1):
            raise bad("min_score_ratio", f"must be in (0, 1] (a fraction of the FP32 score), got {self.min_score_ratio}")
        if self.min_score is not None and not math.isfinite(self.min_score):
            raise bad("min_score", f"must be a finite number, got {self.min_score}")
        if self.min_score is not None and self.min_score_ratio != DEFAULT_MIN_SCORE_RATIO:
            raise UsageError(f"min_score and --min-score-ratio are both given: an absolute min_score replaces the "
                             f"ratio, so --min-score-ratio {self.min_score_ratio:g} would be ignored\n"
                             f"  fix: give one of them", field="min_score")
        if not (0 <= self.max_mismatch_rate <= 1):
            raise bad("max_mismatch_rate", f"must be a fraction in [0, 1], got {self.max_mismatch_rate}")
        from ..trial import OUTPUT_DTYPES

        if self.output_dtype not in OUTPUT_DTYPES:
            raise bad("output_dtype", f"must be one of {', '.join(OUTPUT_DTYPES)} (compute: outputs in the candidate's "
                                      f"compute precision; fp32: the FP32 model's dtypes), got {self.output_dtype!r}")
        if self.fp8_fast_accum not in FP8_FAST_ACCUM_MODES:
            raise bad("fp8_fast_accum", f"must be one of {', '.join(FP8_FAST_ACCUM_MODES)} (auto: tried and kept "
                                        f"when faster within the FP8 limit), got {self.fp8_fast_accum!r}")
        if self.autotune not in AUTOTUNE_MODES:
            raise bad("autotune", f"must be one of {', '.join(AUTOTUNE_MODES)} (auto: a max-autotune rebuild of the best "
                                  f"compiled candidate when the compile budget allows), got {self.autotune!r}")
        if self.calibration is not None and (not isinstance(self.calibration, str) or not self.calibration.strip()):
            raise bad("calibration", f"must be the path of a folder of input batches, got {self.calibration!r}")

    def to_dict(self) -> dict:
        """Every field, JSON-ready (``report.json``'s ``config``; worker processes receive it)."""
        return asdict(self)

    def to_json(self) -> str:
        """The configuration as JSON (:meth:`from_json` reads it back): how a worker process receives it."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "TuneConfig":
        """The inverse of :meth:`to_json` (lists become tuples).

        Raises:
            UsageError: not a JSON object of TuneConfig fields, or a field out of range.
        """
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise UsageError(f"config is not JSON: {exc}", field="config") from None
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or not set(data) <= names or "out_dir" not in data:
            raise UsageError(f"config must be a JSON object of {', '.join(sorted(names))}", field="config")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
