"""What one trial is, typed: its parameters (:class:`TrialParams`), how it failed (:class:`FailureKind`), and the
graph it measures (:func:`build_trial_graph`), shared by the search, ``tctune optimize``'s export and
``tctune export`` so that an exported graph is by construction the measured one.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace
from typing import Any, Iterable, Sequence

import torch

from passes import PIPELINE, PassFailure, build_graph
from passes.policy import POLICIES, pass_spec

from .errors import PassError, UsageError

#: Seed for the fresh random inputs of each batch size: ``INPUT_SEED + batch_size`` (every candidate at one batch,
#: and the export's fp16 calibration, see the same inputs).
INPUT_SEED = 1234

MEMORY_FORMATS = ("contiguous", "channels_last")
#: Output-dtype contracts (``TuneConfig.output_dtype``, the backend's ``output_dtype`` option): ``"compute"``:
#: floating outputs stay in the dtype the candidate computes them in, as ``model.half()`` / ``torch.autocast``
#: return them; ``"fp32"``: the FP32 model's output dtypes (low outputs cast up inside the call).
OUTPUT_DTYPES = ("compute", "fp32")


class FailureKind(str, enum.Enum):
    """Why a trial was rejected (the ``fail_kind`` user attribute of a failed or infeasible trial)."""

    OUT_OF_MEMORY = "out_of_memory"
    ACCURACY = "accuracy"
    CONSTRAINT = "constraint"  # over --max-latency-ms / --max-memory-mib
    COMPILE_BUDGET = "compile_budget"
    INTERRUPTED = "interrupted"
    PASS_ERROR = "pass_error"
    RUNTIME_ERROR = "runtime_error"
    SKIPPED = "skipped"  # not measured: a duplicate, a twin, a batch the graph does not accept


@dataclass(frozen=True)
class TrialParams:
    """One candidate configuration.

    Attributes:
        batch_size: items per call (≥ 1).
        precision: ``fp32``, ``tf32``, ``fp16``, ``bf16`` or ``fp8``.
        graph_passes: True: tctune's rewritten graph; False: the model as written (autocast at fp16/bf16).
        runtime: one of ``tctune.runtime.ALL_RUNTIMES`` (``eager``, ``cudagraphs``, ``inductor``,
            ``inductor-max-autotune``, ``inductor-cudagraphs``, ``inductor-max-autotune-cudagraphs``).
        policy: the cast policy of tctune's graph (``passes.policy.POLICIES``).
        memory_format: ``contiguous`` or ``channels_last``.
        fp8_keep: at precision fp8, module-path patterns whose linears stay bf16 (``()`` below fp8).
        calibration: at fp16, tctune's graph keeps the nodes that overflow fp16 on the reference inputs
            (``INPUT_SEED + batch_size``) and on the run's real batches (``--calibration`` or the model file's
            ``calibration_inputs()``, :mod:`tctune.calibration`) in FP32. True by default: the seeded reference
            inputs exist without real data; it has no effect elsewhere and the repr shows it only where it applies.
        fp8_fast_accum: at precision fp8, tctune's FP8 GEMMs use ``torch._scaled_mm``'s fast accumulation
            (``passes.base.PassSpec.fp8_fast_accum``); always False below fp8. Resolved per trial like
            ``fp8_keep`` (``TuneConfig.fp8_fast_accum``), not one of :attr:`SEARCHED`.
    """

    batch_size: int
    precision: str
    graph_passes: bool = False
    runtime: str = "eager"
    policy: str = "autocast"
    memory_format: str = "contiguous"
    fp8_keep: tuple[str, ...] = ()
    calibration: bool = True
    fp8_fast_accum: bool = False

    #: The keys Optuna searches (a trial's ``params``); the others are resolved per trial.
    SEARCHED = ("batch_size", "precision", "graph_passes", "runtime", "policy", "memory_format")

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise UsageError(f"batch_size must be a positive int, got {self.batch_size!r}", field="batch_size")
        if self.policy not in POLICIES:
            raise UsageError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}", field="policy")
        if self.memory_format not in MEMORY_FORMATS:
            raise UsageError(f"memory_format must be one of {', '.join(MEMORY_FORMATS)}, got {self.memory_format!r}",
                             field="memory_format")
        object.__setattr__(self, "fp8_keep", tuple(self.fp8_keep or ()) if self.precision == "fp8" else ())
        if not isinstance(self.fp8_fast_accum, bool):
            raise UsageError(f"fp8_fast_accum must be true or false, got {self.fp8_fast_accum!r}",
                             field="fp8_fast_accum")
        object.__setattr__(self, "fp8_fast_accum", self.fp8_fast_accum and self.precision == "fp8")

    @classmethod
    def from_params(cls, params: dict, fp8_keep: Iterable[str] | None = None, calibration: bool = True,
                    fp8_fast_accum: bool = False) -> "TrialParams":
        """From a trial's ``params`` (only the searched keys; absent ones take their defaults)."""
        known = {k: params[k] for k in cls.SEARCHED if k in params}
        return cls(**known, fp8_keep=tuple(fp8_keep or ()), calibration=calibration, fp8_fast_accum=fp8_fast_accum)

    def to_dict(self) -> dict:
        """Every field, JSON-ready (``fp8_keep`` as a list)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["fp8_keep"] = list(self.fp8_keep)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrialParams":
        """The inverse of :meth:`to_dict` (unknown keys are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: (tuple(v) if k == "fp8_keep" else v) for k, v in d.items() if k in names})

    def to_config(self, searched: dict) -> dict:
        """The ``best_config.json`` keys for this trial: ``params`` (the searched ``searched`` dict as Optuna
        stored it), ``fp8_keep`` and ``fp8_fast_accum`` (precision fp8 only) and ``calibration``."""
        out: dict[str, Any] = {"params": dict(searched), "calibration": self.calibration}
        if self.precision == "fp8":
            out["fp8_keep"] = list(self.fp8_keep)
            out["fp8_fast_accum"] = self.fp8_fast_accum
        return out

    @classmethod
    def from_config(cls, cfg: dict) -> "TrialParams":
        """From a ``best_config.json`` (:meth:`to_config`; a file without ``calibration`` was calibrated, one
        without ``fp8_fast_accum`` measured full-precision accumulation).

        Raises:
            UsageError: ``fp8_fast_accum`` is not a bool."""
        return cls.from_params(cfg["params"], cfg.get("fp8_keep"), bool(cfg.get("calibration", True)),
                               cfg.get("fp8_fast_accum", False))

    def but(self, **changes) -> "TrialParams":
        return replace(self, **changes)

    def __repr__(self) -> str:
        """Every field that applies to this trial: ``fp8_keep`` and ``fp8_fast_accum`` only at fp8, ``calibration``
        only for tctune's graph at fp16 (the one build it changes), so a repr never suggests a calibration that did
        not run."""
        shown = [f for f in fields(self)
                 if (f.name not in ("fp8_keep", "fp8_fast_accum") or self.precision == "fp8")
                 and (f.name != "calibration" or (self.precision == "fp16" and self.graph_passes))]
        return f"TrialParams({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"


def measuring_device() -> torch.device:
    """``cuda:0`` when torch sees a GPU, else the CPU."""
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def reference_inputs(mf, batch_size: int, device) -> tuple:
    """The seeded fresh random inputs every candidate at ``batch_size`` is measured on (``mf.inputs``). Inputs that
    are not batched (``mf.batched_mask()``) are the tensors ``example_inputs`` returns, the same shape at every
    batch size; dynamic dimensions other than the batch take the sizes ``example_inputs`` gives them."""
    mf.batched_mask()  # its first call draws example inputs: before the seed, so every call draws the same rows
    torch.manual_seed(INPUT_SEED + batch_size)
    return mf.inputs(batch_size, device)


def apply_passes(gm: torch.fx.GraphModule, hw, precision: str, names: Sequence[str] = PIPELINE,
                 calibration: Sequence[tuple] | None = None, policy: str = "autocast",
                 fp8_keep: Iterable[str] = (), training: bool = False,
                 output_dtype: str = "fp32", fp8_fast_accum: bool = False) -> tuple[torch.fx.GraphModule, list]:
    """``passes.build_graph`` for a hardware target (``hw``: a ``tctune.hardware.HardwareSpec``); ``gm`` untouched.
    ``fp8_fast_accum``: at precision fp8, ``torch._scaled_mm``'s fast accumulation (``PassSpec.fp8_fast_accum``).
    ``output_dtype`` (:data:`OUTPUT_DTYPES`): ``"fp32"`` casts the graph's outputs back to the FP32 model's
    dtypes; ``"compute"`` leaves floating outputs in their computed dtype (``PassSpec.restore_output_dtypes``).

    Raises:
        PassError: a cast pass failed (the message names it and the passes before it).
        UsageError: ``output_dtype`` is not one of :data:`OUTPUT_DTYPES`.
    """
    if output_dtype not in OUTPUT_DTYPES:
        raise UsageError(f"output_dtype must be one of {', '.join(OUTPUT_DTYPES)}, got {output_dtype!r}",
                         field="output_dtype")
    spec = pass_spec(hw, precision, training=training, policy=policy, fp8_keep=fp8_keep,
                     restore_output_dtypes=output_dtype == "fp32", fp8_fast_accum=fp8_fast_accum)
    try:
        return build_graph(gm, spec, names, calibration)
    except PassFailure as exc:
        raise PassError(str(exc)) from exc


def build_trial_graph(gm: torch.fx.GraphModule, hw, trial: TrialParams, calibration: Sequence[tuple] | None,
                      names: Sequence[str] = PIPELINE, output_dtype: str = "fp32") -> tuple[torch.fx.GraphModule, list]:
    """The graph trial ``trial`` measures (its precision, policy, FP8 keep-list and fast accumulation; at fp16 the
    overflow calibration on ``calibration`` when ``trial.calibration``). ``names``: the passes (the engines drop
    ``fuse_epilogue``, which has no ONNX translation and fires on CUDA graphs only). ``output_dtype``: the
    output contract (:data:`OUTPUT_DTYPES`; the search passes ``TuneConfig.output_dtype``; the engines keep
    ``"fp32"``, the dtypes their runners hand to numpy, which has no bfloat16).

    Raises:
        PassError: a cast pass failed.
        UsageError: an unknown ``output_dtype``.
    """
    return apply_passes(gm, hw, trial.precision, names, calibration if trial.calibration else None,
                        trial.policy, trial.fp8_keep, output_dtype=output_dtype, fp8_fast_accum=trial.fp8_fast_accum)


__all__ = ["FailureKind", "INPUT_SEED", "MEMORY_FORMATS", "OUTPUT_DTYPES", "TrialParams", "apply_passes", "build_trial_graph",
           "measuring_device", "reference_inputs"]
