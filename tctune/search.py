"""Optuna search over batch size × precision × graph passes, every candidate measured.

One study per (model, hardware, mode, search space), stored by default in ``<out>/study.db`` (SQLite), so
running the same command again resumes it: finished trials are kept and new ones are added. The FP32
eager baseline at every searched batch size is enqueued first, so the report's speedups are like-for-like
(measured in the same study, on the same inputs).
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import signal
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import optuna
import torch

from passes.policy import POLICIES

from .capture import Captured, batch_range, try_capture
from .errors import CandidateRejected, ModelFileError, PassError, UsageError
from .fp8_plan import FP8Plan, choose_fastest, plan_graph
from .hardware import HardwareSpec
from .measure import (ErrorStats, check_accuracy, compare, is_oom, precision_mode, release_memory,
                      time_call)
from .modelfile import ModelFile
from .trial import FailureKind, TrialParams, apply_passes, build_trial_graph, measuring_device, reference_inputs
from .runtime import CUDA_GRAPH_RUNTIMES, RUNTIMES_CPU, RUNTIMES_GPU, Autocast, ChannelsLast, detach_outputs, wrap

log = logging.getLogger("tctune")

TRAIN_NO_PASSES = ("training runs the model as written (autocast; GradScaler for fp16): tctune's graph passes "
                   "are inference rewrites and are not applied in --mode train yet")

#: Study directions per objective: throughput (items/s), p99 latency (ms), peak memory (MiB).
OBJECTIVES = {"throughput": ("maximize",), "latency": ("minimize",), "pareto": ("maximize", "minimize", "minimize")}

#: Search spaces with at most this many combinations are enumerated (no candidate measured twice).
BRUTE_FORCE_MAX = 96
#: After the trials, the (at most) CONFIRM_TOP fastest feasible candidates within CONFIRM_BAND of the fastest are
#: built and timed once more, and the winner is the best by the mean of both timings. Why: on the H200 the seed
#: CNN's search took Inductor without a CUDA graph at 6.25 M img/s over Inductor + CUDA graph at 6.14 M (1.7 %
#: apart, a 0.17 ms call), and the same configuration timed again in that process ran 5.48 M
#: (benchmarks/NOTES.md): one timing of a launch-bound candidate can be 12 % off.
CONFIRM_TOP = 3
CONFIRM_BAND = 0.05


@dataclass(frozen=True)
class TuneConfig:
    """Options of one ``tctune optimize`` run (serialized into ``report.json``).

    Attributes:
        batch_sizes: batch sizes to search (items per call).
        trials: trials to add to the study in this run (≥ 1).
        timeout_s: stop starting new trials after this many seconds (None: no limit).
        max_error: largest relative L2 error against the FP32 reference a candidate may have.
        max_error_fp8: the same for FP8 candidates (E4M3 keeps 3 mantissa bits; 5e-2 ≈ 26 dB SQNR).
        target: ``--target`` name or ``sm_XX`` (plan for that GPU's alignment); None: the detected device.
        storage: Optuna storage URL; None: ``sqlite:///<out>/study.db``.
        seed: sampler seed.
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

    def __post_init__(self) -> None:
        from .runtime import ALL_RUNTIMES
        if self.runtimes is not None:
            bad = [r for r in self.runtimes if r not in ALL_RUNTIMES]
            if bad or not self.runtimes:
                raise UsageError(f"--runtimes: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(ALL_RUNTIMES)}")
        if self.mode not in ("infer", "train"):
            raise UsageError(f"--mode must be infer or train, got {self.mode!r}")
        if self.effective_batch is not None and (self.mode != "train" or self.effective_batch < 1):
            raise UsageError("--effective-batch needs --mode train and a positive number of samples")
        if self.devices is not None and (not self.devices or len(set(self.devices)) != len(self.devices)
                                         or any(d < 0 for d in self.devices)):
            raise UsageError(f"--devices must be distinct GPU indices such as 0,1 — got {self.devices}")
        if self.objective not in OBJECTIVES:
            raise UsageError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        for name, v in (("--max-latency-ms", self.max_latency_ms), ("--max-memory-mib", self.max_memory_mib)):
            if v is not None and v <= 0:
                raise UsageError(f"{name} must be positive, got {v}")
        if self.compile_budget_s <= 0:
            raise UsageError(f"--compile-budget must be a positive number of seconds, got {self.compile_budget_s}")
        if not self.batch_sizes or any((not isinstance(b, int)) or b < 1 for b in self.batch_sizes):
            raise UsageError(f"--batch-sizes must be positive integers, got {self.batch_sizes!r}")
        if self.trials < 1:
            raise UsageError(f"--trials must be at least 1, got {self.trials}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise UsageError(f"--timeout must be a positive number of seconds, got {self.timeout_s}")
        if not (self.max_error > 0):
            raise UsageError(f"--max-error must be positive, got {self.max_error}")
        if not (self.max_error_fp8 > 0):
            raise UsageError(f"--max-error-fp8 must be positive, got {self.max_error_fp8}")
        if self.fp8_keep is not None and (isinstance(self.fp8_keep, str)
                                          or not all(isinstance(p, str) and p.strip() for p in self.fp8_keep)):
            raise UsageError(f"--fp8-keep must be auto, none or comma-separated module-path patterns, got {self.fp8_keep!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Candidate:
    """A runnable candidate: ``module(*inputs)`` under ``precision_mode(precision)``."""

    module: Callable
    precision: str
    passes: list = field(default_factory=list)  # PassResult objects
    description: str = ""
    fp8_keep: tuple[str, ...] | None = None  # precision fp8, tctune's graph: the keep-list it was built with


class Tuner:
    """Runs the study for one model file on one hardware spec.

    Args:
        cfg: run options.
        mf: the loaded model file.
        hw: hardware spec (detected, ``--target``, or CPU) that sets alignment and allowed precisions.
        device: where candidates are measured.
    """

    def __init__(self, cfg: TuneConfig, mf: ModelFile, hw: HardwareSpec, device: torch.device | None = None):
        self.cfg, self.mf, self.hw = cfg, mf, hw
        self.device = device or measuring_device()
        self.model = mf.model().to(self.device)
        self.model.train(cfg.mode == "train")
        self.precisions = hw.search_precisions(measure_on_gpu=self.device.type == "cuda", training=cfg.mode == "train")
        if cfg.mode == "train":
            self.captured = Captured(None, TRAIN_NO_PASSES)
        else:
            cap_inputs = mf.inputs(2, self.device)
            with precision_mode("fp32"):
                self.captured = try_capture(self.model, cap_inputs)
        self._refs: dict[int, tuple[tuple, Any]] = {}
        self.out_dir = Path(cfg.out_dir)
        default = RUNTIMES_GPU if self.device.type == "cuda" else RUNTIMES_CPU
        if cfg.mode == "train":
            default = tuple(r for r in default if r not in CUDA_GRAPH_RUNTIMES)
        self.runtimes = tuple(cfg.runtimes or default)
        graphed = [r for r in self.runtimes if r in CUDA_GRAPH_RUNTIMES]
        if cfg.mode == "train" and graphed:
            raise UsageError(f"--runtimes {graphed[0]} is for inference; in --mode train use eager or inductor")
        if self.device.type != "cuda" and graphed:
            raise UsageError(f"--runtimes {graphed[0]} needs a CUDA GPU; this machine measures on the CPU\n"
                             f"  fix: --runtimes {','.join(RUNTIMES_CPU)} (or run on a GPU machine)")
        if "eager" not in self.runtimes:
            raise UsageError(f"--runtimes {','.join(self.runtimes)} leaves out eager, which the FP32 eager baselines "
                             f"every result is compared with need\n  fix: --runtimes eager,{','.join(self.runtimes)}")
        if cfg.max_memory_mib is not None and self.device.type != "cuda":
            log.warning("--max-memory-mib limits peak CUDA memory; this run measures on the %s, where it is not "
                        "measured, so the limit is ignored", self.device.type.upper())
        if cfg.effective_batch:
            for bs in cfg.batch_sizes:
                if cfg.effective_batch % bs:
                    steps = -(-cfg.effective_batch // bs)
                    log.warning("--effective-batch %d is not a multiple of batch size %d: its optimizer steps take "
                                "%d micro-batch(es), %d samples", cfg.effective_batch, bs, steps, steps * bs)
        if "fp8" not in self.precisions and (cfg.fp8_keep is not None or cfg.max_error_fp8 != TuneConfig.max_error_fp8):
            log.warning("precision fp8 is not searched here (it needs FP8 Tensor Cores, sm_89 or newer, a GPU to "
                        "measure on and --mode infer), so --fp8-keep / --max-error-fp8 have no effect")
        self.compile_over_budget: str | None = None
        self.fp8_plans: dict[str, FP8Plan] = {}  # policy -> planned FP8 keep-list (when --fp8-keep is auto)
        self._opened = False
        self.interrupted = False

    # -- search space ---------------------------------------------------------------------------------
    @property
    def pass_choices(self) -> list[bool]:
        return [True, False] if self.captured.ok else [False]

    def space(self) -> dict:
        space = {"batch_size": list(self.cfg.batch_sizes), "precision": list(self.precisions),
                 "graph_passes": self.pass_choices, "runtime": list(self.runtimes)}
        if self.searches_policy:
            space["policy"] = list(POLICIES)
        if self.searches_memory_format:
            space["memory_format"] = ["contiguous", "channels_last"]
        return space

    @property
    def searches_memory_format(self) -> bool:
        """Channels-last is searched for models with 2-D convolutions, on a GPU (cuDNN's NHWC kernels)."""
        return (self.device.type == "cuda" and self.cfg.mode == "infer"
                and any(isinstance(m, torch.nn.Conv2d) for m in self.model.modules()))

    @property
    def searches_policy(self) -> bool:
        """The cast policy (autocast-accurate or pure, like model.half()) is searched on a GPU, for the graph."""
        return (self.device.type == "cuda" and self.captured.ok and self.cfg.mode == "infer"
                and any(p in ("fp16", "bf16") for p in self.precisions))

    def candidate(self, **params) -> dict:
        """Trial parameters with the defaults of the dimensions this study searches."""
        if self.searches_policy:
            params.setdefault("policy", "autocast")
        if self.searches_memory_format:
            params.setdefault("memory_format", "contiguous")
        return params

    def study_name(self) -> str:
        key = json.dumps(self.space(), sort_keys=True)
        digest = hashlib.sha1(key.encode()).hexdigest()[:8]
        cc = self.hw.compute_capability or "cpu"
        obj = "" if self.cfg.objective == "throughput" else f"-{self.cfg.objective}"
        return f"{self.mf.name}-{self.hw.arch}-{cc}-{self.device.type}-{self.cfg.mode}{obj}-{digest}"

    def storage_url(self) -> str:
        return self.cfg.storage or f"sqlite:///{(self.out_dir / 'study.db').resolve()}"

    # -- candidates -------------------------------------------------------------------------------------
    def reference(self, batch_size: int) -> tuple[tuple, Any]:
        """Fresh random inputs for ``batch_size`` (seeded, so every candidate sees the same) and FP32 outputs."""
        if batch_size not in self._refs:
            inputs = reference_inputs(self.mf, batch_size, self.device)
            try:
                with precision_mode("fp32"), torch.inference_mode():
                    ref = self.model(*inputs)
            except Exception as exc:
                release_memory(self.device)
                if is_oom(exc):
                    raise CandidateRejected(f"the FP32 reference ran out of memory at batch size {batch_size}") from exc
                raise CandidateRejected(f"the model raised at batch size {batch_size} (FP32 reference run): "
                                        f"{type(exc).__name__}: {_first_line(exc)}") from exc
            self._refs[batch_size] = (inputs, ref)
        return self._refs[batch_size]

    def build(self, params: dict, fp8_keep: Sequence[str] | None = None) -> Candidate:
        """The candidate for trial ``params`` before its runtime wrapper (``batch_size``, ``precision``,
        ``graph_passes``, ``policy``, ``memory_format``; ``runtime`` is applied by :meth:`evaluate`).
        ``fp8_keep``: see :meth:`keep_for` (a trial's recorded ``fp8_keep``, rebuilt)."""
        cand = self._build(params, fp8_keep)
        if params.get("memory_format") == "channels_last":
            module = cand.module if params["graph_passes"] else copy.deepcopy(cand.module)  # never the reference
            cand.module = ChannelsLast(module.to(memory_format=torch.channels_last))
            cand.description += ", channels-last"
        return cand

    def trial_params(self, params: dict, fp8_keep: Sequence[str] | None = None) -> TrialParams:
        """The typed parameters of trial ``params`` with its FP8 keep-list resolved (:meth:`keep_for`)."""
        keep = self.keep_for(params, fp8_keep) if params.get("graph_passes") else ()
        return TrialParams.from_params(params, keep)

    def _build(self, params: dict, fp8_keep: Sequence[str] | None = None) -> Candidate:
        precision = params["precision"]
        runtime = params.get("runtime", "eager")
        if params["graph_passes"]:
            trial = self.trial_params(params, fp8_keep)
            inputs, _ = self.reference(trial.batch_size)
            g, results = build_trial_graph(self.captured.graph_module, self.hw, trial, [inputs])
            keep, policy = trial.fp8_keep, trial.policy
            label = f"{precision} ({policy})" if precision in ("fp16", "bf16") else precision
            if precision == "fp8":
                label += f" (bf16: {', '.join(keep)})" if keep else " (every eligible linear)"
            return Candidate(g.to(self.device), precision, results, f"tctune graph {label}, {runtime}",
                             fp8_keep=keep if precision == "fp8" else None)
        if precision in ("fp16", "bf16"):
            dtype = torch.float16 if precision == "fp16" else torch.bfloat16
            return Candidate(Autocast(self.model, dtype, self.device.type), precision, [],
                             f"model autocast {precision}, {runtime}")
        return Candidate(self.model, precision, [], f"model {precision}, {runtime}")

    def keep_for(self, params: dict, recorded: Sequence[str] | None = None) -> tuple[str, ...]:
        """The FP8 keep-list the graph of trial ``params`` is built with: ``()`` below precision fp8; else
        ``recorded`` (the list a finished trial measured, its ``fp8_keep`` user attribute) when given, so a rebuild
        is that graph even if this process planned differently, or :meth:`fp8_keep`."""
        if params["precision"] != "fp8":
            return ()
        if recorded is not None:
            return tuple(recorded)
        return self.fp8_keep(params.get("policy", "autocast"), params["batch_size"])

    def fp8_keep(self, policy: str, batch_size: int) -> tuple[str, ...]:
        """The FP8 keep-list for graph candidates with ``policy``: ``--fp8-keep``'s patterns, or the one planned
        once per policy from the error of FP8 graphs on the FP32 reference inputs at ``batch_size``
        (:func:`tctune.fp8_plan.plan_fp8_keep`, aiming at 0.9 × ``--max-error-fp8``).

        Raises:
            CandidateRejected: no linear can run FP8 within the limit (the plan's reason).
        """
        if self.cfg.fp8_keep is not None:
            return tuple(self.cfg.fp8_keep)
        if policy not in self.fp8_plans:
            self.fp8_plans[policy] = self._plan_fp8(policy, batch_size)
            log.info("FP8 plan (%s policy): %s", policy, self.fp8_plans[policy].summary())
        plan = self.fp8_plans[policy]
        if not plan.usable:
            raise CandidateRejected(plan.reason, FailureKind.ACCURACY)
        return plan.keep

    def _plan_fp8(self, policy: str, batch_size: int) -> FP8Plan:
        inputs, ref = self.reference(batch_size)
        try:
            gm, hw = self.captured.graph_module, self.hw
            plan = plan_graph(lambda keep, names: apply_passes(gm, hw, "fp8", names, policy=policy, fp8_keep=keep)[0],
                              inputs, ref, self.cfg.max_error_fp8, device=self.device)
        except PassError:
            raise
        except Exception as exc:  # noqa: BLE001 - an FP8 graph that cannot run rejects the FP8 candidates
            raise rejection(exc, self.device, batch_size, "FP8 keep-list planning") from exc
        return choose_fastest(plan, lambda keep: self._fp8_throughput(policy, keep, inputs))

    def _fp8_throughput(self, policy: str, keep: tuple[str, ...], inputs: tuple) -> float | None:
        """Throughput (items/s) of the FP8 graph with ``keep`` through the fastest runtime searched (the one
        :meth:`compiled_first` uses; eager when none is compiled), or None when it fails (logged)."""
        runtime = self.fastest_compiled_runtime or "eager"
        fn = None
        try:
            g, _ = apply_passes(self.captured.graph_module, self.hw, "fp8", policy=policy, fp8_keep=keep)
            with precision_mode("fp8"):
                fn, _ = wrap(g.to(self.device), runtime, inputs)
                timing = time_call(lambda: fn(*inputs), len(inputs[0]), self.device)
            return timing.throughput
        except Exception as exc:  # noqa: BLE001 - one keep-list failing leaves the others
            log.info("FP8 keep-list %s could not be timed: %s", ", ".join(keep) or "(none)", _first_line(exc))
            return None
        finally:
            fn = g = None
            release_memory(self.device)

    def evaluate(self, params: dict, on_repeat=None, fp8_keep: Sequence[str] | None = None) -> dict:
        """Build, check and time one candidate; returns the trial's metrics (``fp8_keep``: see :meth:`build`).

        Raises:
            CandidateRejected: out of memory, NaN/inf outputs, or a broken rewrite.
        """
        bs = params["batch_size"]
        runtime = params.get("runtime", "eager")
        inputs, ref = self.reference(bs)
        release_memory(self.device)  # what earlier candidates left (CUDA graph pools, compiled code)
        held = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        cand = self.build(params, fp8_keep)
        # Peak memory is reported per candidate: the peak during its run, minus what tctune itself holds
        # (references for other batch sizes, the FP32 model), plus the inputs and, for the model as written,
        # its weights, which the candidate uses but which were allocated before it.
        own = sum(t.numel() * t.element_size() for t in inputs)
        if not params["graph_passes"]:
            own += sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))
        setup_s = 0.0
        fn = None
        try:
            with precision_mode(cand.precision):
                fn, setup_s = wrap(cand.module, runtime, inputs)
                if runtime.startswith("inductor") and setup_s > self.cfg.compile_budget_s:
                    self.compile_over_budget = f"trial compile took {setup_s:.0f} s"
                    raise CandidateRejected(f"compile took {setup_s:.0f} s > --compile-budget {self.cfg.compile_budget_s:g} s",
                                            FailureKind.COMPILE_BUDGET)
                with torch.inference_mode():
                    out = detach_outputs(fn(*inputs))
            err: ErrorStats = compare(out, ref)
            try:
                check_accuracy(err, cand.precision, out)
            except CandidateRejected as exc:
                exc.kind = exc.kind or FailureKind.ACCURACY
                raise
            del out
            with precision_mode(cand.precision):
                timing = time_call(lambda: fn(*inputs), bs, self.device, on_repeat=on_repeat,
                                   target_repeat_s=0.1 if self.device.type == "cuda" else 0.15)
        except (CandidateRejected, optuna.TrialPruned):
            raise
        except Exception as exc:
            raise rejection(exc, self.device, bs, f"{runtime} run") from exc
        finally:
            cand.module = fn = None  # drop the candidate's weights / CUDA graph / compiled code now
            release_memory(self.device)
        peak = None
        if timing.peak_memory_mib is not None:
            peak = timing.peak_memory_mib - (held - own) / 2**20
        extra = {} if cand.fp8_keep is None else {"fp8_keep": list(cand.fp8_keep)}  # export rebuilds this graph
        return trial_metrics(timing, err, peak_memory_mib=peak, setup_s=setup_s, description=cand.description,
                             passes=[{"name": r.name, "changed": r.count, **({"failed": r.notes["failed"]} if "failed" in r.notes else {})}
                                     for r in cand.passes], **extra)

    # -- study ------------------------------------------------------------------------------------------
    def space_size(self) -> int:
        n = 1
        for choices in self.space().values():
            n *= len(choices)
        return n

    def make_sampler(self) -> optuna.samplers.BaseSampler:
        """Small spaces are enumerated without repeats (Optuna's BruteForceSampler, random order); larger
        ones use TPE, where accuracy is a constraint (``Trial.set_constraint``) it learns from."""
        if self.space_size() <= BRUTE_FORCE_MAX:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.samplers.BruteForceSampler(seed=self.cfg.seed)
        return optuna.samplers.TPESampler(seed=self.cfg.seed, n_startup_trials=8)

    def create_study(self) -> optuna.Study:
        sampler = self.make_sampler()
        url = self.storage_url()
        if self.cfg.storage is None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            study, storage = _open_study(url, self.study_name(), list(OBJECTIVES[self.cfg.objective]), sampler,
                                         prune=self.cfg.prune)
        except Exception as exc:
            raise UsageError(
                f"cannot open the study storage {url}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}\n"
                f"  fix: check --storage (an Optuna storage URL such as sqlite:///study.db or "
                f"postgresql://user@host/db) and that the server is reachable") from exc
        if self.cfg.storage is None and not self._opened:
            # The default SQLite study has one tctune process (it starts any workers itself, after this):
            # a trial still RUNNING was cut off by a killed process.
            self.fail_interrupted(study, storage)
        if not self._opened:
            self.retry_interrupted(study)
        self._opened = True
        if not study.trials:
            for bs in self.cfg.batch_sizes:  # FP32 eager baselines, one per batch size
                study.enqueue_trial(self.candidate(batch_size=bs, precision="fp32", graph_passes=False, runtime="eager"))
            for params in self.compiled_first():
                study.enqueue_trial(params)
            if self.captured.ok:  # then tctune's graph at each low precision, largest batch
                for p in self.precisions:
                    if p != "fp32":
                        study.enqueue_trial(self.candidate(batch_size=max(self.cfg.batch_sizes), precision=p,
                                                           graph_passes=True, runtime="eager"))
                if self.searches_policy:
                    for p in self.precisions:
                        if p in ("fp16", "bf16"):
                            study.enqueue_trial(self.candidate(batch_size=max(self.cfg.batch_sizes), precision=p,
                                                               graph_passes=True, runtime="eager", policy="pure"))
        return study

    @property
    def fastest_compiled_runtime(self) -> str | None:
        """``inductor-cudagraphs`` when searched, else ``inductor``, else None (the H200's fastest first)."""
        return next((r for r in ("inductor-cudagraphs", "inductor") if r in self.runtimes), None)

    def compiled_first(self) -> list[dict]:
        """The candidates measured right after the FP32 baselines: tctune's graph through the fastest compiled
        runtime searched (``inductor-cudagraphs``, else ``inductor``) at each low precision of the search
        (fp16, bf16, fp8), largest batch, policy ``pure`` where the policy is searched, and for conv nets once
        more channels-last after fp16.

        Why first: on the H200 that runtime won on all five suite models (benchmarks/RESULTS.md: BERT-base,
        BERT-large, GPT-2, ResNet-50, seed CNN), while TPE's first random draws are unlikely to combine graph +
        compiled runtime + pure policy; a run cut short by ``--timeout`` or few ``--trials`` then still has
        measured the likely winner. They are measured like any trial (and can lose). Empty for training, for a
        model that did not capture, or when no compiled runtime is searched.
        """
        fast = self.fastest_compiled_runtime
        if fast is None or not self.captured.ok or self.cfg.mode != "infer":
            return []
        bs = max(self.cfg.batch_sizes)
        out = []
        for p in ("fp16", "bf16", "fp8"):
            extra = {"policy": "pure"} if self.searches_policy else {}
            if p in self.precisions:
                out.append(self.candidate(batch_size=bs, precision=p, graph_passes=True, runtime=fast, **extra))
                if p == "fp16" and self.searches_memory_format:
                    out.append(self.candidate(batch_size=bs, precision=p, graph_passes=True, runtime=fast,
                                              memory_format="channels_last", **extra))
        return out

    def retry_interrupted(self, study: optuna.Study) -> int:
        """Enqueue again the candidates whose only trials were cut off (Ctrl-C, a killed process): the
        enumerating sampler counts them as visited, so without this they would never be measured."""
        measured = self.measured(study)
        waiting = {json.dumps(t.params, sort_keys=True)
                   for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))}
        space = self.space()
        n = 0
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,)):
            key = json.dumps(t.params, sort_keys=True)
            if counts_as_measured(t) or key in measured or key in waiting:
                continue
            if any(t.params.get(k) not in v for k, v in space.items()):
                continue
            study.enqueue_trial(dict(t.params))
            waiting.add(key)
            n += 1
        if n:
            log.info("%d interrupted candidate(s) queued to be measured again", n)
        return n

    def skip_reason(self, study: optuna.Study, params: dict, number: int = 1 << 62) -> str | None:
        """Why ``params`` need not be measured: already measured, a smaller batch with the same settings
        ran out of memory, or compiles are over budget. None when it should be measured."""
        same_settings = {k: v for k, v in params.items() if k != "batch_size"}
        done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
        for prev in study.get_trials(deepcopy=False, states=done + (optuna.trial.TrialState.RUNNING,)):
            if prev.number == number or not counts_as_measured(prev):
                continue
            if prev.params == params:
                if prev.state == optuna.trial.TrialState.RUNNING:
                    if prev.number < number:  # another worker took it first
                        return f"duplicate of trial {prev.number} (being measured by another worker)"
                    continue
                what = "measured" if prev.state == optuna.trial.TrialState.COMPLETE else "failed"
                return f"duplicate of trial {prev.number} ({what}; not run again)"
            if (prev.user_attrs.get("fail_kind") == FailureKind.OUT_OF_MEMORY.value and {k: v for k, v in prev.params.items() if k != "batch_size"} == same_settings
                    and prev.params.get("batch_size", 0) <= params["batch_size"]):
                return f"batch {prev.params['batch_size']} already ran out of memory with these settings (trial {prev.number})"
        if params.get("policy") == "pure" and (not params.get("graph_passes")
                                               or params["precision"] not in ("fp16", "bf16", "fp8")):
            # at fp8 the policy is that of the bf16 cast around the FP8 GEMMs (on the H200, BERT-base's planned
            # FP8 graph: 20,088 seq/s pure against 15,854 autocast, benchmarks/RESULTS.md)
            return "policy pure applies only to tctune's fp16/bf16/fp8 graph (this candidate equals its autocast twin)"
        if params["precision"] == "fp8" and not params.get("graph_passes"):
            return "fp8 needs tctune's graph (FP8 GEMMs are a graph rewrite; the model as written has none)"
        if params.get("graph_passes") and self.captured.ok:
            lo, hi = batch_range(self.captured.graph_module)
            if not lo <= params["batch_size"] <= hi:
                return (f"tctune's graph accepts batch {lo}..{hi} (torch.export narrowed the dynamic batch); "
                        f"batch {params['batch_size']} runs only as written")
        if params.get("runtime", "").startswith("inductor") and self.compile_over_budget:
            return f"compiles are over --compile-budget ({self.compile_over_budget})"
        return None

    @staticmethod
    def fail_interrupted(study: optuna.Study, storage) -> int:
        """Mark the study's RUNNING trials FAIL with the reason "interrupted"; returns how many."""
        running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        if not running:
            return 0
        sid = storage.get_study_id_from_name(study.study_name)
        for t in running:
            tid = storage.get_trial_id_from_study_id_trial_number(sid, t.number)
            storage.set_trial_user_attr(tid, "fail_reason", "interrupted: the process ended during this trial")
            storage.set_trial_user_attr(tid, "fail_kind", FailureKind.INTERRUPTED.value)
            storage.set_trial_state_values(tid, optuna.trial.TrialState.FAIL)
        log.warning("marked %d interrupted trial(s) as failed; finished trials are kept", len(running))
        return len(running)

    def objective(self, trial: optuna.Trial) -> float:
        space = self.space()
        params = {k: trial.suggest_categorical(k, v) for k, v in space.items()}
        skip = self.skip_reason(trial.study, params, trial.number)
        if skip:
            fail(trial, skip, FailureKind.SKIPPED)
            raise optuna.TrialPruned(skip)
        def on_repeat(step: int, throughput: float) -> None:
            if self.cfg.objective != "throughput":
                return
            trial.report(throughput, step)
            if trial.should_prune():
                reason = (f"stopped early: {throughput:.4g} items/s after {step + 1} repeat(s), in the slowest "
                          "quarter of the trials so far (Optuna PercentilePruner)")
                trial.set_user_attr("fail_reason", reason)
                raise optuna.TrialPruned(reason)

        try:
            metrics = self.evaluate(params, on_repeat=on_repeat)
        except CandidateRejected as exc:
            fail(trial, str(exc), failure_kind(exc))
            raise
        except PassError as exc:
            fail(trial, str(exc), FailureKind.PASS_ERROR)
            raise CandidateRejected(str(exc), FailureKind.PASS_ERROR) from exc
        except (ModelFileError, UsageError, optuna.TrialPruned):
            raise  # the user's files or options: one clear error for the whole run; or stopped early
        except Exception as exc:  # anything else a candidate raises costs that trial, not the study
            reason = f"{type(exc).__name__}: {_first_line(exc)}"
            fail(trial, reason, FailureKind.RUNTIME_ERROR)
            raise CandidateRejected(reason, FailureKind.RUNTIME_ERROR) from exc
        for k, v in metrics.items():
            trial.set_user_attr(k, v)
        fp8 = params["precision"] == "fp8"
        limits = {"max_error": (metrics["max_rel_error"], self.cfg.max_error_fp8 if fp8 else self.cfg.max_error,
                                "relative error", "--max-error-fp8" if fp8 else "--max-error"),
                  "max_latency_ms": (metrics["latency_p99_ms"], self.cfg.max_latency_ms, "p99 latency ms", "--max-latency-ms"),
                  "max_memory_mib": (metrics["peak_memory_mib"], self.cfg.max_memory_mib, "peak memory MiB", "--max-memory-mib")}
        over, kind = [], None
        for key, (value, limit, what, flag) in limits.items():
            if limit is None or value is None:
                continue
            trial.set_constraint(key, float(value - limit))
            if value > limit:
                over.append(f"{what} {value:.3g} > {flag} {limit:g}")
                kind = kind or (FailureKind.ACCURACY if key == "max_error" else FailureKind.CONSTRAINT)
        if over:
            fail(trial, "; ".join(over), kind)
        return objective_values(metrics, self.cfg.objective)

    def run(self) -> optuna.Study:
        """Add ``cfg.trials`` trials to the study (resuming it), with a progress bar unless quiet.

        Ctrl-C (SIGINT) once: the running trial finishes, then the study stops and the report is written.
        Twice: the running trial is abandoned (marked failed). Finished trials are always kept.
        """
        self.out_dir.mkdir(parents=True, exist_ok=True)
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # tctune reports failed trials itself
        study = self.create_study()
        total = self.cfg.trials
        if self.space_size() <= BRUTE_FORCE_MAX:  # an enumerated space ends when every candidate is measured
            left = self.space_size() - len(self.measured(study))
            if left <= 0:
                log.info("all %d candidates of this search space are already measured; nothing to add "
                         "(widen --batch-sizes or --runtimes to search more)", self.space_size())
                return study
            if left < total:
                log.info("this search space has %d candidates, %d not measured yet: at most %d trials run, not "
                         "--trials %d", self.space_size(), left, left, total)
                total = left
        bar = None
        if not self.cfg.quiet:
            from tqdm.auto import tqdm
            bar = tqdm(total=total, desc="trials", unit="trial", file=sys.stderr, dynamic_ncols=True)

        stop_requested = []

        def on_sigint(signum, frame):
            self.interrupted = True
            if stop_requested:
                raise KeyboardInterrupt
            stop_requested.append(True)
            log.warning("Ctrl-C: stopping after the current trial (press Ctrl-C again to abandon it)")

        def callback(st: optuna.Study, tr: optuna.trial.FrozenTrial) -> None:
            if stop_requested:
                st.stop()
            if tr.state == optuna.trial.TrialState.FAIL and bar is None:
                log.info("trial %d rejected: %s", tr.number, tr.user_attrs.get("fail_reason"))
            if bar is None:
                return
            best = best_trial(st)
            p = tr.params
            state = tr.state.name.lower()
            bar.set_postfix_str(
                f"#{tr.number} {p.get('precision')} b{p.get('batch_size')} {'graph' if p.get('graph_passes') else 'eager'}: "
                f"{state}; best {best.user_attrs['throughput']:.4g}/s" if best else f"#{tr.number} {state}")
            bar.update(1)

        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            study.optimize(self.objective, n_trials=self.cfg.trials, timeout=self.cfg.timeout_s,
                           catch=(CandidateRejected,), callbacks=[callback])
        except KeyboardInterrupt:
            self.interrupted = True
            log.warning("interrupted: finished trials are kept in %s; writing the report", self.storage_url())
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            if bar is not None:
                bar.close()
        if self.space_size() <= BRUTE_FORCE_MAX and len(self.measured(study)) >= self.space_size():
            log.info("every one of the %d candidates of this search space is measured", self.space_size())
        if not self.interrupted and not self.cfg.worker and self.cfg.objective == "throughput":
            self.confirm(study)
        return study

    def confirm(self, study: optuna.Study) -> dict | None:
        """Time the fastest feasible candidates within ``CONFIRM_BAND`` of the fastest once more (at most
        ``CONFIRM_TOP``), each rebuilt; :func:`best_trial` then takes the best mean of the two timings.

        Stored as the study user attribute ``"confirmation"``: ``{"band", "after_trial", "runs": {trial number
        (str): [throughput, re-measured throughput or None, ...]}}`` (items/s; None: a re-run was rejected, e.g.
        out of memory). A resumed study adds its re-measurements to those of earlier runs, so the mean uses
        every timing taken. Nothing is stored when fewer than two candidates are within the band. A candidate
        that fails again is logged, never raised.
        """
        ok = sorted((t for t in study.get_trials(deepcopy=False) if is_feasible(t)),
                    key=lambda t: -t.user_attrs["throughput"])
        if len(ok) < 2:
            return None
        fastest = ok[0].user_attrs["throughput"]
        top = [t for t in ok[:CONFIRM_TOP] if t.user_attrs["throughput"] >= fastest * (1 - CONFIRM_BAND)]
        if len(top) < 2:
            return None
        log.info("re-measuring the %d fastest candidates (within %.0f%% of the fastest) once more", len(top),
                 CONFIRM_BAND * 100)
        runs: dict[str, list] = dict((study.user_attrs.get("confirmation") or {}).get("runs") or {})
        for t in top:
            again = None
            try:  # the graph this trial measured (its keep-list), even if a resumed run plans anew
                again = self.evaluate(dict(t.params), fp8_keep=t.user_attrs.get("fp8_keep"))["throughput"]
            except CandidateRejected as exc:  # the first timing stands; a programming error is not swallowed
                log.info("trial %d could not be re-measured: %s", t.number, _first_line(exc))
            runs[str(t.number)] = [*(runs.get(str(t.number)) or [t.user_attrs["throughput"]]), again]
        conf = {"band": CONFIRM_BAND, "after_trial": max(t.number for t in study.get_trials(deepcopy=False)),
                "runs": runs}
        study.set_user_attr("confirmation", conf)
        means = confirmed_throughputs(study)
        again_ok = [str(t.number) for t in top if runs[str(t.number)][-1] is not None]
        log.info("re-measured %d of %d: %s", len(again_ok), len(top),
                 "; ".join(f"trial {n}: mean {means[int(n)]:.4g}/s" for n in again_ok) or "none")
        return conf

    @staticmethod
    def measured(study: optuna.Study) -> set[str]:
        """Parameter sets already decided (complete, failed, or pruned: stopped early as clearly slower, or a
        twin not measured), as canonical JSON strings. Pruned ones count because the enumerating sampler never
        proposes them again either; without them a resumed run promised trials that could only be duplicates."""
        done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.PRUNED)
        return {json.dumps(t.params, sort_keys=True) for t in study.get_trials(deepcopy=False)
                if t.state in done and counts_as_measured(t)}


def make_pruner(directions: list[str], enabled: bool = True) -> optuna.pruners.BasePruner:
    """A candidate whose throughput after its first repeats is below the slowest quarter of the trials
    measured so far stops early (throughput studies; Optuna does not prune multi-objective studies)."""
    if enabled and directions == ["maximize"]:
        return optuna.pruners.PercentilePruner(25.0, n_startup_trials=6, n_warmup_steps=1)
    return optuna.pruners.NopPruner()


def _open_study(url: str, name: str, directions: list[str], sampler, attempts: int = 5, prune: bool = True):
    """Create or load study ``name`` in the storage at ``url``; returns ``(study, storage)``.

    Several workers starting at once race to create the storage's tables (PostgreSQL: a unique-constraint
    violation in its catalog) and the study (``DuplicatedStudyError``): the losers wait and try again, and
    then find what the winner created.
    """
    import sqlalchemy.exc

    for attempt in range(1, attempts + 1):
        try:
            if url.startswith(("sqlite:", "postgresql", "mysql")):
                # A heartbeat lets any worker fail the trials of a worker that was killed (shared studies).
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    storage = optuna.storages.RDBStorage(url, heartbeat_interval=30, grace_period=120)
            else:
                storage = url
            study = optuna.create_study(study_name=name, storage=storage, directions=directions, sampler=sampler,
                                        pruner=make_pruner(directions, prune), load_if_exists=True)
            return study, storage
        except (optuna.exceptions.DuplicatedStudyError, sqlalchemy.exc.IntegrityError):
            if attempt == attempts:
                raise
            time.sleep(0.3 * attempt)
    raise AssertionError("unreachable")


def rejection(exc: BaseException, device: torch.device, batch_size: int, what: str) -> CandidateRejected:
    """The :class:`CandidateRejected` for an exception a candidate raised, after freeing its memory."""
    release_memory(device)
    if is_oom(exc):
        return CandidateRejected(f"out of memory at batch size {batch_size}", FailureKind.OUT_OF_MEMORY)
    return CandidateRejected(f"{what} failed: {type(exc).__name__}: {_first_line(exc)}", FailureKind.RUNTIME_ERROR)


def failure_kind(exc: CandidateRejected) -> FailureKind:
    """The kind of a rejection: the one its raiser set, else out of memory when it was caused by one (the
    timing loop's rejection), else a runtime error."""
    if exc.kind is not None:
        return FailureKind(exc.kind)
    cause = exc.__cause__
    if cause is not None and is_oom(cause):
        return FailureKind.OUT_OF_MEMORY
    return FailureKind.RUNTIME_ERROR


def fail(trial: optuna.Trial, reason: str, kind: FailureKind) -> None:
    """Record why ``trial`` failed: ``fail_reason`` (text for the report) and ``fail_kind`` (a FailureKind value)."""
    trial.set_user_attr("fail_reason", reason)
    trial.set_user_attr("fail_kind", kind.value)


def trial_metrics(timing, err: ErrorStats, **extra) -> dict:
    """The user attributes every measured trial records (units: items/s, ms, MiB)."""
    metrics = {
        "throughput": timing.throughput,
        "latency_ms": timing.latency_ms,
        "latency_p50_ms": timing.latency_p50_ms,
        "latency_p99_ms": timing.latency_p99_ms,
        "peak_memory_mib": timing.peak_memory_mib,
        "max_rel_error": err.rel_l2_error,
        "max_abs_error": err.max_abs_error,
        "nonfinite": err.nonfinite,
        "repeats_ms": timing.repeats_ms,
    }
    metrics.update(extra)
    return metrics


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def objective_values(metrics: dict, objective: str) -> float | tuple[float, ...]:
    """The value(s) Optuna optimizes for ``objective`` (see :data:`OBJECTIVES`)."""
    if objective == "throughput":
        return metrics["throughput"]
    p99 = metrics["latency_p99_ms"] if metrics["latency_p99_ms"] is not None else metrics["latency_ms"]
    if objective == "latency":
        return p99
    return metrics["throughput"], p99, metrics["peak_memory_mib"] or 0.0


def counts_as_measured(t: optuna.trial.FrozenTrial) -> bool:
    """A finished trial whose result stands. A trial that failed because the process was interrupted or
    killed (no reason recorded, or "interrupted") does not: its candidate is measured again later."""
    if t.state != optuna.trial.TrialState.FAIL:
        return True
    if t.user_attrs.get("fail_kind") == FailureKind.INTERRUPTED.value:
        return False
    return bool(t.user_attrs.get("fail_reason"))


def is_feasible(t: optuna.trial.FrozenTrial) -> bool:
    """A completed, measured trial within every constraint (``--max-error``, ``--max-latency-ms``, ...)."""
    constraints = t.constraints
    return (t.state == optuna.trial.TrialState.COMPLETE and "throughput" in t.user_attrs
            and all(c <= 0 for c in constraints.values()))


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The feasible trial that is best for the study's objective, or None.

    Throughput and Pareto studies: highest throughput (for Pareto, among the front's members all are
    reported; this is the one a throughput user would pick). Latency studies: lowest p99 latency.
    """
    ok = [t for t in study.get_trials(deepcopy=False) if is_feasible(t)]
    if not ok:
        return None
    if list(study.directions) == [optuna.study.StudyDirection.MINIMIZE]:
        return min(ok, key=lambda t: t.values[0])
    fastest = max(ok, key=lambda t: t.user_attrs["throughput"])
    conf = confirmed_throughputs(study)
    if conf and fastest.number <= study.user_attrs["confirmation"]["after_trial"] and any(t.number in conf for t in ok):
        # re-measured after the trials (Tuner.confirm): the best mean of its timings, among those candidates
        return max((t for t in ok if t.number in conf), key=lambda t: conf[t.number])
    return fastest


def confirmed_throughputs(study: optuna.Study) -> dict[int, float]:
    """Trial number -> mean throughput of its timings (first + re-measured, :meth:`Tuner.confirm`), or {}."""
    conf = study.user_attrs.get("confirmation") or {}
    out = {}
    for number, values in (conf.get("runs") or {}).items():
        vals = [v for v in values if v]
        if vals:
            out[int(number)] = sum(vals) / len(vals)
    return out


def pareto_front(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Optuna's Pareto front (feasible trials only) of a multi-objective study; [] otherwise."""
    if len(study.directions) < 2:
        return []
    return [t for t in study.best_trials if is_feasible(t)]
