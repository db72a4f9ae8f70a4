"""Model suite: tctune against every plain baseline on five models, one process, under 7 minutes on an H200.

Usage::

    python benchmarks/suite.py --out DIR [--models bert_base,bert_large,gpt2,resnet50,seed_cnn] [--quick]
    python benchmarks/suite.py --out DIR --dry-run      # tiny configs on the CPU, to check the script

Without a CUDA GPU (and without ``--dry-run``) it prints why and exits 0. Writes ``DIR/latest.json`` (rewritten
after every model, so a killed run keeps what it finished) and prints a compact table.

Models (recipes/*.py, random weights) and shapes: ``bert_base`` (64, 128), ``bert_large`` (64, 384), ``gpt2``
(32, 512; logits over V = 50257), ``resnet50`` (256, 3, 224, 224), ``seed_cnn`` (1024, 3, 32, 32), inference.

Variants per model, all on the same fresh inputs (seeded), each compared with FP32 eager's output
(relative L2 over the flattened output, float64, NaN/inf counted):

baselines (the model as written)
    ``fp32_eager``      IEEE FP32 (TF32 off): the reference; its forward is also counted by FlopCounterMode
    ``tf32_eager``      TF32 on for matmul and cuDNN
    ``autocast_bf16``   ``torch.autocast(dtype=bfloat16)`` (tctune.runtime.Autocast)
    ``fp16_eager``      ``copy.deepcopy(model).half()``; channels-last for the conv nets; floating inputs are
                        cast (and made channels-last) inside the timed call
    ``fp16_compile``    ``torch.compile`` of that fp16 model (mode default); compile time is recorded apart
    ``fp16_compile_fp32_out``  the same with its outputs cast back to float32 inside the compiled module: Inductor
                        alone under the FP32 model's output contract, which tctune's graph and backend keep
    ``fp8_torchao_compile``  torchao's FP8 inference recipe (``quantize_`` with
                        ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` on the bf16 model, every
                        ``nn.Linear``), then ``torch.compile``; transformer models on sm_89+ with torchao installed
tctune (conv nets channels-last, weights and inputs, like their fp16 baselines)
    ``tctune_{bf16,fp16}_eager``        the captured graph (tctune.capture: torch.export, dynamic batch) after
                                        ``tctune.trial.apply_passes`` with the spec from ``tctune.hardware.resolve()``
    ``tctune_{bf16,fp16}_cudagraphs``   the same graph replayed as one CUDA graph (``tctune.runtime.wrap``;
                                        the input copy is timed)
    ``tctune_fp16_pure_inductor``       the fp16 pure-policy graph compiled by Inductor (``tctune.runtime.wrap``
                                        runtime ``inductor``: ``torch.compile`` mode default, the search's runtime)
    ``tctune_fp16_pure_inductor_cudagraphs``  that compiled graph replayed as one CUDA graph
    ``tctune_fp8_inductor_cudagraphs``  tctune's FP8 graph (``apply_passes(..., "fp8", policy="pure")``: eligible
                                        linears as per-row FP8 ``_scaled_mm``, the rest bf16) through Inductor as
                                        one CUDA graph (the search's ``inductor-cudagraphs`` runtime)
    ``tctune_fp8keep_inductor_cudagraphs``  the same with the model's FP8 keep-list in bf16 (BERT:
                                        ``*.output.dense``, the attention-output and FFN-down projections)
    ``tctune_fp8plan_inductor_cudagraphs``  the same with the keep-list ``tctune optimize`` plans
                                        (``tctune.fp8_plan.plan_graph`` on these inputs, aim 0.9 × 5e-2)
    ``tctune_compile_fp16_pure``        ``torch.compile(fp32 model, backend=tctune.backend.backend(precision="fp16",
                                        policy="pure"))``; ``backend_seconds`` splits its compile into export,
                                        passes and Inductor
    ``tctune_optimize``                 what ``tctune optimize`` chooses: ``tctune.search.Tuner`` on the recipe at
                                        this model's batch size only (``--optimize-trials``, default 16, every
                                        other option ``tctune optimize``'s default; ``--optimize-budget`` s), its
                                        best trial rebuilt (``Tuner.build`` + its runtime) and measured here like
                                        every variant; ``optimize`` in the row: the search's wall time, trials, the
                                        chosen configuration and the throughput the search itself measured

Summary per model: ``tctune`` is ``tctune_optimize`` (what ``tctune optimize`` chose) when it ran within the error
limit, else the fastest tctune variant; ``fastest_variant*`` name the fastest tctune variant beside it (fixed
configurations such as a hand-written FP8 keep-list, which the search does not choose by itself).

Timing: ``tctune.measure.time_call`` (CUDA events, 2 warm-up calls, median of 5 repeats of ~0.05 s; no
single-call percentiles; a CPU dry run times fewer repeats). Throughput is items/s (sequences or images). A
variant counts when its error is within 1e-2 (5e-2 for FP8 variants, issue 4's limits) and finite;
``best_baseline`` is the fastest baseline that counts, ``tctune`` as said above. The GEMM ceiling (8192³ matmul at fp32, tf32, fp16, bf16, and fp8 e4m3
through ``torch._scaled_mm`` with per-tensor scales, bf16 output) is measured once; ``achieved_tflops`` is
FlopCounterMode's FLOPs of one FP32 forward (useful FLOPs: padding is not counted) times batches/s.

Time budget (``--budget``, default 390 s for the whole process, imports included): each model gets
``min(its limit, its share of what is left)``; limits (s): bert_base 85, bert_large 105, gpt2 85, resnet50 85,
seed_cnn 40 (400 in all; the run_h200.sh step is killed at 420; the seed CNN's 40 s leave its ``tctune_optimize``
the 24 s it needs to start). Planned from the H200 numbers of
benchmarks/RESULTS.md (BERT-base: Inductor compile 11.5 s, tctune backend compile 44.8 s): each model's eager
and CUDA-graph variants and capture take 15-40 s, the Inductor baseline compile 10-30 s, and tctune's backend
gets what is left; on BERT-large (24 layers) that compile is expected not to fit and to be recorded as a
timeout. Cheap variants run first, compiles last. Every variant runs under a SIGALRM deadline (the model's
remaining time; for a compile also ``--compile-budget``, default 60 s): when it fires the variant is recorded
as ``timeout`` with the reason and the model goes on (a compile is abandoned and Dynamo reset). A variant is
not started when the model has less time left than it needs (recorded as ``skipped``). ``--quick`` skips the
``torch.compile`` variants (baseline, tctune graph + Inductor, backend). ``--model-limit S`` (or ``NAME=S,...``) replaces every
(named) model's limit (for runs of one or two models with every compile); ``--policies pure`` skips the autocast-policy
graph variants; ``--variants PATTERNS`` runs only the named variants (fnmatch, e.g. ``'fp16_*,*fp8*'``) and
records the rest as skipped. Memory is released between variants.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime as _dt
import fnmatch
import gc
import importlib.util
import json
import os
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

_T_START = time.perf_counter()

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torch.utils._pytree import tree_map  # noqa: E402

from tctune.measure import compare, precision_mode, time_call  # noqa: E402
from tctune.modelfile import load_model_file  # noqa: E402
from tctune.runtime import Autocast, ChannelsLast, wrap  # noqa: E402
from tctune.search import TuneConfig  # noqa: E402

INPUT_SEED = 1234
#: Issue 4's error limits (relative to FP32): FP8 variants, every other precision — `tctune optimize`'s defaults.
MAX_ERROR, MAX_ERROR_FP8 = TuneConfig.max_error, TuneConfig.max_error_fp8
GEMM_N = 8192


@dataclass(frozen=True)
class ModelSpec:
    """One suite model: its recipe, batch, whether it is a conv net, its time limit and its tiny dry-run form."""

    recipe: str
    batch: int
    items: str
    conv: bool
    limit_s: float
    tiny_batch: int
    #: FP8 keep-list of the ``tctune_fp8keep`` variant (``PassSpec.fp8_keep``); empty: no such variant.
    fp8_keep: tuple = ()


MODELS: dict[str, ModelSpec] = {
    "bert_base": ModelSpec("bert_base", 64, "seq", False, 85, 2, fp8_keep=("*.output.dense",)),
    "bert_large": ModelSpec("bert_large", 64, "seq", False, 105, 2, fp8_keep=("*.output.dense",)),
    "gpt2": ModelSpec("gpt2", 32, "seq", False, 85, 2),
    "resnet50": ModelSpec("resnet50", 256, "img", True, 85, 2),
    "seed_cnn": ModelSpec("seed_cnn", 1024, "img", True, 40, 8),
}

BASELINES = ("fp32_eager", "tf32_eager", "autocast_bf16", "fp16_eager", "fp16_compile", "fp16_compile_fp32_out",
             "fp8_torchao_compile")
#: tctune's graph at each precision and cast policy ("" = autocast-accurate, "_pure" = like model.half()).
GRAPH_VARIANTS = tuple((prec, policy) for policy in ("autocast", "pure") for prec in ("bf16", "fp16"))
_SFX = {"autocast": "", "pure": "_pure"}
#: tctune's fp16 pure graph handed to Inductor (the search's ``inductor`` runtime), alone and replayed as a CUDA graph.
INDUCTOR_VARIANTS = ("tctune_fp16_pure_inductor", "tctune_fp16_pure_inductor_cudagraphs")
#: tctune's FP8 graph (pure policy) through Inductor as one CUDA graph: every eligible linear, and with the
#: model's FP8 keep-list (``ModelSpec.fp8_keep``) in bf16.
FP8_VARIANTS = ("tctune_fp8_inductor_cudagraphs", "tctune_fp8keep_inductor_cudagraphs", "tctune_fp8plan_inductor_cudagraphs")
TCTUNE = tuple(f"tctune_{p}{_SFX[pol]}_{rt}" for p, pol in GRAPH_VARIANTS for rt in ("eager", "cudagraphs")) + (
    INDUCTOR_VARIANTS + FP8_VARIANTS + ("tctune_compile_fp16_pure", "tctune_optimize"))
PRECISION = {"fp32_eager": "fp32", "tf32_eager": "tf32", "autocast_bf16": "bf16", "fp16_eager": "fp16",
             "fp16_compile": "fp16", "fp16_compile_fp32_out": "fp16", "tctune_compile_fp16_pure": "fp16", "fp8_torchao_compile": "fp8",
             **{v: "fp8" for v in FP8_VARIANTS},
             **{v: "fp16" for v in INDUCTOR_VARIANTS},
             **{f"tctune_{p}{_SFX[pol]}_{rt}": p for p, pol in GRAPH_VARIANTS for rt in ("eager", "cudagraphs")}}
#: Seconds a variant needs left on its model's clock to be started (compiles: see ``--compile-budget``).
MIN_LEFT_S = {"cudagraphs": 6.0, "compile": 12.0, "other": 3.0}


# ------------------------------------------------------------------------------------------------ deadlines


class VariantTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so library code's ``except Exception`` does not swallow it."""


@contextlib.contextmanager
def deadline(seconds: float, what: str):
    """Raise :class:`VariantTimeout` in the main thread after ``seconds`` (inside Python code, including a
    compile waiting on its worker pool)."""
    if seconds <= 0:
        raise VariantTimeout(f"{what}: no time left")

    def fire(signum, frame):
        raise VariantTimeout(f"{what} passed its {seconds:.0f} s limit")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------------------------ models


def load_recipe(name: str):
    """The recipe's checked :class:`~tctune.modelfile.ModelFile` and its imported module."""
    mf = load_model_file(ROOT / "recipes" / f"{name}.py")
    return mf, sys.modules[f"tctune_model_{mf.name}"]


TINY_BERT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
             "vocab_size": 1000, "max_position_embeddings": 64}


def build(name: str, dry_run: bool, device: torch.device) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The FP32 eval model on ``device`` and its seeded fresh inputs (dry run: a tiny config of the same family).

    Raises:
        tctune.errors.ModelFileError: the recipe cannot be built (e.g. ``transformers``/``torchvision`` missing).
    """
    spec = MODELS[name]
    mf, mod = load_recipe(spec.recipe)
    if not dry_run:
        with device:  # random initialization on the GPU: seconds faster for BERT-large than on the CPU
            model = mf.model()
        torch.manual_seed(INPUT_SEED + spec.batch)
        inputs = mf.inputs(spec.batch, device)
        return model.eval().to(device), inputs
    b = spec.tiny_batch
    torch.manual_seed(INPUT_SEED + b)
    if name == "seed_cnn":
        model, inputs = mf.model(), mf.inputs(b)
    elif name == "bert_base":
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        model = mod.BertEncoder(BertModel(BertConfig(**TINY_BERT), add_pooling_layer=False))
        inputs = (torch.randint(0, 1000, (b, 16)),)
    elif name == "bert_large":
        model = mod.make_model(**TINY_BERT)
        inputs = (torch.randint(0, 1000, (b, 16)),)
    elif name == "gpt2":  # vocabulary 1001: misaligned like 50257, so the padding pass has work
        model = mod.make_model(n_embd=64, n_layer=2, n_head=4, vocab_size=1001, n_positions=64,
                               bos_token_id=0, eos_token_id=0)
        inputs = (torch.randint(0, 1001, (b, 16)),)
    elif name == "resnet50":
        try:
            from torchvision.models.resnet import Bottleneck, ResNet
        except ImportError as exc:
            from tctune.errors import ModelFileError
            raise ModelFileError(f"resnet50 (tiny) needs torchvision: {exc}") from exc
        torch.manual_seed(0)
        model = ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10)
        inputs = (torch.randn(b, 3, 32, 32),)
    else:
        raise KeyError(name)
    return model.eval().to(device), tuple(x.to(device) for x in inputs)


class FP32Outputs(torch.nn.Module):
    """Returns ``module``'s floating outputs as float32: the FP32 model's output contract, which tctune's graph
    and backend keep (``model.half()`` returns fp16)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *inputs):
        return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                        self.module(*inputs))


class HalfModel(torch.nn.Module):
    """``model.half()`` (channels-last for conv nets); floating inputs are cast inside the call."""

    def __init__(self, model: torch.nn.Module, channels_last: bool):
        super().__init__()
        self.model = copy.deepcopy(model).half()
        self.channels_last = channels_last
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)

    def forward(self, *inputs):
        args = []
        for x in inputs:
            if x.is_floating_point():
                x = x.half()
                if self.channels_last and x.dim() == 4:
                    x = x.contiguous(memory_format=torch.channels_last)
            args.append(x)
        return self.model(*args)


# ------------------------------------------------------------------------------------------------ measuring


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def error_stats(out: Any, ref: Any) -> dict:
    """Relative L2 (max over floating outputs), max-abs and NaN/inf count of ``out`` against ``ref``: tctune's own
    ``tctune.measure.compare`` (float64 on the outputs' device, a chunk at a time)."""
    err = compare(out, ref)
    return {"rel_l2_error": err.rel_l2_error, "max_abs_error": err.max_abs_error, "nonfinite": err.nonfinite}


def timed(fn: Callable[[], Any], batch: int, device: torch.device) -> dict:
    """``time_call`` by the suite's protocol (the CPU dry run only checks the code: 1 warm-up, 3 short repeats)."""
    if device.type == "cuda":
        t = time_call(fn, batch, device, warmup=2, repeats=5, target_repeat_s=0.05, max_iterations=100,
                      single_calls=0)
    else:
        t = time_call(fn, batch, device, warmup=1, repeats=3, target_repeat_s=0.01, max_iterations=20,
                      single_calls=0)
    return {"throughput": t.throughput, "latency_ms": t.latency_ms, "repeats_ms": t.repeats_ms,
            "iterations": t.iterations, "peak_memory_mib": t.peak_memory_mib}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def gemm_ceilings(device: torch.device, n: int) -> dict:
    """TFLOP/s of an n×n×n matmul per precision (fp8: e4m3 × e4m3 → bf16 via ``torch._scaled_mm``)."""
    out: dict[str, Any] = {}
    flops = 2.0 * n ** 3
    for prec in ("fp32", "tf32", "fp16", "bf16", "fp8"):
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            if prec == "fp8":
                a = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn)
                b = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn).t()  # column-major
                one = torch.ones((), device=device)
                fn = lambda a=a, b=b, one=one: torch._scaled_mm(a, b, scale_a=one, scale_b=one,  # noqa: E731
                                                                 out_dtype=torch.bfloat16)
            else:
                dt = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[prec]
                a = torch.randn(n, n, device=device, generator=gen).to(dt)
                b = torch.randn(n, n, device=device, generator=gen).to(dt)
                fn = lambda a=a, b=b: a @ b  # noqa: E731
            with precision_mode(prec):
                t = time_call(fn, 1, device, warmup=2, repeats=5, target_repeat_s=0.05, single_calls=0)
            out[prec] = float(f"{flops / (t.latency_ms / 1e3) / 1e12:.4g}")
        except Exception as exc:  # noqa: BLE001 - an unsupported precision is recorded, not fatal
            out[prec] = None
            out.setdefault("errors", {})[prec] = first_line(exc)
        finally:
            a = b = fn = None  # noqa: F841
            release(device)
    return out


class Clock:
    """The whole run's budget and the current model's deadline."""

    def __init__(self, budget_s: float):
        self.end = _T_START + budget_s
        self.model_end = self.end

    def left(self) -> float:
        return self.end - time.perf_counter()

    def model_left(self) -> float:
        return min(self.model_end, self.end) - time.perf_counter()

    def start_model(self, name: str, todo: list[str]) -> float:
        """Set the model's deadline: its limit, or its share of what is left when that is less."""
        weights = sum(MODELS[m].limit_s for m in todo) or 1.0
        share = max(0.0, self.left() - 5.0) * MODELS[name].limit_s / weights
        limit = min(MODELS[name].limit_s, share)
        self.model_end = time.perf_counter() + limit
        return limit


def run_model(name: str, args, device: torch.device, hw, clock: Clock, ceilings: dict) -> dict:
    """Measure every variant of one model; returns its JSON entry."""
    import tctune.backend as tb
    from tctune.capture import capture
    from tctune.fp8_plan import plan_graph
    from tctune.trial import apply_passes

    spec = MODELS[name]
    batch = spec.tiny_batch if args.dry_run else spec.batch
    entry: dict[str, Any] = {"batch": batch, "items": spec.items, "variants": {}}
    variants: dict[str, dict] = entry["variants"]
    t_model = time.perf_counter()
    try:
        with deadline(clock.model_left(), f"{name}: building the model"):
            model, inputs = build(name, args.dry_run, device)
    except (Exception, VariantTimeout) as exc:
        entry["error"] = f"cannot build {name}: {first_line(exc)}"
        print(f"{name}: {entry['error']}", flush=True)
        return finish(entry, ceilings)
    entry["input_shapes"] = [list(x.shape) for x in inputs]
    entry["parameters"] = sum(p.numel() for p in model.parameters())
    cuda = device.type == "cuda"

    # FP32 reference (and FLOPs of one forward), kept for every variant's error.
    from torch.utils.flop_counter import FlopCounterMode
    try:
        with precision_mode("fp32"), torch.inference_mode(), FlopCounterMode(display=False) as counter:
            ref = model(*inputs)
        entry["flops_per_batch"] = int(counter.get_total_flops())
    except Exception as exc:  # noqa: BLE001
        entry["error"] = f"FP32 reference failed: {first_line(exc)}"
        return finish(entry, ceilings)
    ref = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, ref)

    def measure(vname: str, make: Callable[[], tuple[Callable, float]], kind: str = "other",
                limit_s: float | None = None, extra: Callable[[], dict] | None = None, reset: bool = True,
                precision: str | None = None) -> None:
        """Build (``make`` returns ``(fn, setup_s)``), check against ``ref`` and time one variant."""
        precision = precision or PRECISION[vname]
        row: dict[str, Any] = {"kind": "baseline" if vname in BASELINES else "tctune", "precision": precision}
        variants[vname] = row
        left = clock.model_left()
        if not selected(vname, args):
            row.update(status="skipped", reason=f"--variants {','.join(args.variants)}")
            return
        if left < MIN_LEFT_S[kind]:
            row.update(status="skipped", reason=f"model time limit: {left:.0f} s left, needs {MIN_LEFT_S[kind]:.0f} s")
            print(f"  {name:<10} {vname:<24} skipped: {row['reason']}", flush=True)
            return
        fn = None
        t0 = time.perf_counter()
        try:
            with deadline(min(left, limit_s) if limit_s else left, vname), precision_mode(precision):
                fn, setup_s = make()
                if setup_s:
                    row["compile_s" if kind == "compile" else "setup_s"] = round(setup_s, 2)
                with torch.inference_mode():
                    out = fn(*inputs)
                row.update(error_stats(out, ref))
                del out
                if row["nonfinite"]:
                    raise RuntimeError(f"{row['nonfinite']} NaN/inf values in the output")
                row.update(timed(lambda: fn(*inputs), batch, device))
            row["status"] = "ok"
            if entry.get("flops_per_batch"):
                row["achieved_tflops"] = entry["flops_per_batch"] * row["throughput"] / batch / 1e12
            if extra:
                row.update(extra())
        except VariantTimeout as exc:
            row.update(status="timeout", reason=str(exc))
            if cuda:
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - one variant failing must not lose the others
            row.update(status="failed", reason=first_line(exc))
            if args.debug:
                traceback.print_exc()
        finally:
            row["wall_s"] = round(time.perf_counter() - t0, 2)
            fn = None
            if kind == "compile" and (reset or row.get("status") != "ok"):
                torch._dynamo.reset()
            release(device)
        if row["status"] == "ok":
            setup = f"  setup {row.get('compile_s', row.get('setup_s', 0)):.1f} s" if (
                "compile_s" in row or "setup_s" in row) else ""
            print(f"  {name:<10} {vname:<24} {row['latency_ms']:9.3f} ms {row['throughput']:12.1f}/s  "
                  f"rel_l2 {row['rel_l2_error']:.2e}{setup}", flush=True)
        else:
            print(f"  {name:<10} {vname:<24} {row['status']}: {row['reason']}", flush=True)

    # -- baselines, cheap first
    measure("fp32_eager", lambda: (model, 0.0))
    measure("tf32_eager", lambda: (model, 0.0))
    measure("autocast_bf16", lambda: (Autocast(model, torch.bfloat16, device.type), 0.0))
    measure("fp16_eager", lambda: (HalfModel(model, spec.conv), 0.0))

    def layout(module: torch.nn.Module) -> torch.nn.Module:
        """Conv nets run channels-last, as their fp16 baselines do (the search's memory-format dimension)."""
        if not spec.conv:
            return module
        return ChannelsLast(module.to(memory_format=torch.channels_last))

    # -- tctune graph: capture once, passes per precision
    gm, capture_reason = None, None
    if clock.model_left() >= MIN_LEFT_S["other"]:
        t0 = time.perf_counter()
        try:
            cap_inputs = tuple(x[:2] for x in inputs) if batch >= 2 else inputs
            with deadline(clock.model_left(), "capture"), precision_mode("fp32"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gm = capture(model, cap_inputs)
            entry["capture_s"] = round(time.perf_counter() - t0, 2)
        except (Exception, VariantTimeout) as exc:
            capture_reason = f"capture failed: {first_line(exc)}"
    else:
        capture_reason = "model time limit reached before capture"
    entry["capture"] = {"ok": gm is not None, "reason": capture_reason}

    for prec, policy in GRAPH_VARIANTS:
        if policy not in args.policies:
            for rt in ("eager", "cudagraphs"):
                variants[f"tctune_{prec}{_SFX[policy]}_{rt}"] = {
                    "kind": "tctune", "precision": prec, "status": "skipped", "reason": f"--policies {','.join(args.policies)}"}
            continue
        passes_info: dict = {}
        built: dict = {}  # the rewritten graph, shared by the eager and CUDA-graph variants of this precision
        tag = f"{prec}{_SFX[policy]}"

        def graph(prec=prec, policy=policy, info=passes_info, built=built):
            if "g" not in built:
                t0 = time.perf_counter()
                g, results = apply_passes(gm, hw, prec, policy=policy)
                built["g"] = layout(g.to(device))
                info["passes"] = {r.name: r.count for r in results}
                info["passes_s"] = round(time.perf_counter() - t0, 2)
            return built["g"]

        def eager(graph=graph):
            return graph(), 0.0

        def graphed(graph=graph):
            if not cuda:
                raise RuntimeError("CUDA graphs need a CUDA GPU")
            return wrap(graph(), "cudagraphs", inputs)

        if gm is None:
            for v in (f"tctune_{tag}_eager", f"tctune_{tag}_cudagraphs"):
                variants[v] = {"kind": "tctune", "precision": prec, "status": "skipped", "reason": capture_reason}
            continue
        measure(f"tctune_{tag}_eager", eager, extra=lambda info=passes_info: dict(info))
        if cuda:
            measure(f"tctune_{tag}_cudagraphs", graphed, kind="cudagraphs", extra=lambda info=passes_info: dict(info))
        else:
            variants[f"tctune_{tag}_cudagraphs"] = {"kind": "tctune", "precision": prec, "status": "skipped",
                                                    "reason": "CUDA graphs need a CUDA GPU"}
        built.clear()
        release(device)

    # -- tctune's fp16 pure graph through Inductor (the search's "inductor" runtime), then as a CUDA graph
    ind: dict = {}

    def graph_inductor():
        torch._dynamo.reset()
        t0 = time.perf_counter()
        g, results = apply_passes(gm, hw, "fp16", policy="pure")
        ind["info"] = {"passes": {r.name: r.count for r in results}, "passes_s": round(time.perf_counter() - t0, 2)}
        ind["fn"], setup = wrap(layout(g.to(device)), "inductor", inputs)
        return ind["fn"], setup

    def graph_inductor_graphed():
        if not cuda:
            raise RuntimeError("CUDA graphs need a CUDA GPU")
        compile_s = 0.0
        if "fn" not in ind:  # the compile-only variant was not selected (--variants) or failed: compile here
            _, compile_s = graph_inductor()
        fn, setup = wrap(ind["fn"], "cudagraphs", inputs)
        return fn, compile_s + setup

    for vname in INDUCTOR_VARIANTS:
        if gm is None or args.quick:
            variants[vname] = {"kind": "tctune", "precision": "fp16", "status": "skipped",
                               "reason": capture_reason if gm is None else "--quick skips torch.compile variants"}
    if gm is not None and not args.quick:
        measure(INDUCTOR_VARIANTS[0], graph_inductor, kind="compile", limit_s=args.compile_budget, reset=False,
                extra=lambda: dict(ind.get("info", {})))
        if cuda:
            measure(INDUCTOR_VARIANTS[1], graph_inductor_graphed, kind="cudagraphs",
                    extra=lambda: dict(ind.get("info", {})))
        else:
            variants[INDUCTOR_VARIANTS[1]] = {"kind": "tctune", "precision": "fp16", "status": "skipped",
                                              "reason": "CUDA graphs need a CUDA GPU"}
        ind.clear()
        torch._dynamo.reset()

    # -- tctune's FP8 graph (pure policy) through Inductor, replayed as one CUDA graph: every eligible linear in
    #    FP8, then with the model's FP8 keep-list in bf16
    for vname, keep in zip(FP8_VARIANTS, ((), spec.fp8_keep, None)):
        reason = fp8_skip_reason(spec, hw, args, gm is None and capture_reason)
        if reason is None and vname == FP8_VARIANTS[1] and not keep:
            reason = "no FP8 keep-list for this model"
        if reason:
            variants[vname] = {"kind": "tctune", "precision": "fp8", "status": "skipped", "reason": reason}
            continue
        fp8_info: dict = {}

        def fp8_graph(keep=keep, info=fp8_info):
            torch._dynamo.reset()
            t0 = time.perf_counter()
            if keep is None:  # planned by tctune.fp8_plan, as `tctune optimize` does (aim 0.9 x the FP8 limit)
                plan = plan_graph(gm, hw, inputs, ref, MAX_ERROR_FP8, policy="pure", device=device)
                info.update(fp8_plan=plan.to_dict(), plan_s=round(time.perf_counter() - t0, 2))
                if not plan.usable:
                    raise RuntimeError(plan.reason)
                keep, t0 = plan.keep, time.perf_counter()
            g, results = apply_passes(gm, hw, "fp8", policy="pure", fp8_keep=keep)
            info.update(passes={r.name: r.count for r in results}, passes_s=round(time.perf_counter() - t0, 2),
                        fp8_keep=list(keep))
            return wrap(g.to(device), "inductor-cudagraphs" if cuda else "inductor", inputs)

        measure(vname, fp8_graph, kind="compile", limit_s=args.compile_budget, extra=lambda info=fp8_info: dict(info))
    gm = None
    release(device)

    # -- what `tctune optimize` chooses at this batch size, rebuilt and measured like every variant
    optimize_variant(name, spec, batch, model, inputs, args, device, hw, clock, variants, measure)

    # -- compiles last: the Inductor baseline, then tctune's backend
    def compiled(module: torch.nn.Module, **kw) -> tuple[Callable, float]:
        torch._dynamo.reset()
        tb.reset()
        c = torch.compile(module, dynamic=False, **kw)
        t0 = time.perf_counter()
        with torch.inference_mode():
            c(*inputs)
        if cuda:
            torch.cuda.synchronize(device)
        return c, time.perf_counter() - t0

    def backend_report() -> dict:
        fallbacks = [r.fallback for r in tb.reports if r.fallback]
        rewrites: dict[str, int] = {}
        for rep in tb.reports:
            for r in rep.results:
                rewrites[r.name] = rewrites.get(r.name, 0) + r.count
        seconds: dict[str, float] = {}
        for rep in tb.reports:
            for k, v in rep.seconds.items():
                seconds[k] = round(seconds.get(k, 0.0) + v, 2)
        return {"subgraphs": len(tb.reports), "fallbacks": fallbacks, "passes": rewrites, "backend_seconds": seconds}

    def torchao_fp8() -> tuple[Callable, float]:
        """torchao's FP8 inference recipe: bf16 model, every ``nn.Linear`` dynamic per-row FP8, torch.compile."""
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        m = copy.deepcopy(model).to(torch.bfloat16)
        saved = torch._inductor.config.save_config()  # torchao sets its recommended Inductor flags globally
        try:
            quantize_(m, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
            return compiled(m)
        finally:
            torch._inductor.config.load_config(saved)

    for vname, make, extra in (
        ("fp16_compile", lambda: compiled(HalfModel(model, spec.conv)), None),
        ("fp16_compile_fp32_out", lambda: compiled(FP32Outputs(HalfModel(model, spec.conv))), None),
        ("fp8_torchao_compile", torchao_fp8, None),
        ("tctune_compile_fp16_pure", lambda: compiled(layout(copy.deepcopy(model)),
                                                       backend=tb.backend(precision="fp16", policy="pure")),
         backend_report),
    ):
        reason = "--quick skips torch.compile variants" if args.quick else None
        if vname == "fp8_torchao_compile":
            reason = fp8_skip_reason(spec, hw, args, None)
            if reason is None and importlib.util.find_spec("torchao") is None:
                reason = "torchao is not installed"
        if reason:
            variants[vname] = {"kind": "baseline" if vname in BASELINES else "tctune", "precision": PRECISION[vname],
                               "status": "skipped", "reason": reason}
            continue
        measure(vname, make, kind="compile", limit_s=args.compile_budget, extra=extra)
        if variants[vname]["status"] == "timeout":
            variants[vname]["reason"] += f" (--compile-budget {args.compile_budget:g} s or the model's time limit)"

    del model, ref, inputs
    release(device)
    entry["wall_s"] = round(time.perf_counter() - t_model, 1)
    return finish(entry, ceilings)


def optimize_variant(name: str, spec: ModelSpec, batch: int, model: torch.nn.Module, inputs: tuple, args,
                     device: torch.device, hw, clock: "Clock", variants: dict, measure: Callable) -> None:
    """``tctune_optimize``: run ``tctune.search.Tuner`` (``tctune optimize``'s engine, its defaults) on this model
    at ``batch`` only, then measure its best trial's configuration with the suite's protocol on ``inputs``."""
    vname = "tctune_optimize"
    reason = None if selected(vname, args) else f"--variants {','.join(args.variants)}"
    if reason is None and args.quick:
        reason = "--quick skips torch.compile variants"
    if reason is None and clock.model_left() < MIN_LEFT_S["compile"] * 2:
        reason = f"model time limit: {clock.model_left():.0f} s left"
    if reason:
        variants[vname] = {"kind": "tctune", "precision": None, "status": "skipped", "reason": reason}
        return
    from tctune.search import Tuner, TuneConfig, best_trial

    mf, _ = load_recipe(spec.recipe)
    study_dir = Path(args.out) / "optimize" / name
    (study_dir / "study.db").unlink(missing_ok=True)  # this run's search, not a resumed one from an earlier run
    # the suite's own model (dry run: the tiny one) and inputs of its shape at any batch size
    mf = dataclasses.replace(mf, build_model=lambda: copy.deepcopy(model).cpu(),
                             example_inputs=lambda b: tuple(torch.cat([x.cpu()] * (b // len(x) + 1))[:b]
                                                            for x in inputs))
    budget = max(10.0, min(args.optimize_budget, clock.model_left() - 40.0))
    info: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        with deadline(budget + 60.0, f"{vname}: the search"):
            cfg = TuneConfig(out_dir=str(study_dir), batch_sizes=(batch,), trials=args.optimize_trials,
                             timeout_s=budget, export=False, quiet=True, storage=f"sqlite:///{study_dir / 'study.db'}")
            study_dir.mkdir(parents=True, exist_ok=True)
            tuner = Tuner(cfg, mf, hw, device)
            study = tuner.run()
            best = best_trial(study)
    except (Exception, VariantTimeout) as exc:  # noqa: BLE001 - the other variants go on
        variants[vname] = {"kind": "tctune", "precision": None, "status": "failed",
                           "reason": f"the search failed: {first_line(exc)}", "wall_s": round(time.perf_counter() - t0, 1)}
        print(f"  {name:<10} {vname:<24} failed: {variants[vname]['reason']}", flush=True)
        torch._dynamo.reset()
        release(device)
        return
    trials = study.get_trials(deepcopy=False)
    info["optimize"] = {"search_s": round(time.perf_counter() - t0, 1), "budget_s": round(budget, 1),
                        "trials": len(trials), "complete": sum(t.state.name == "COMPLETE" for t in trials)}
    if best is None:
        variants[vname] = {"kind": "tctune", "precision": None, "status": "failed",
                           "reason": "the search found no feasible configuration", **info}
        return
    params = dict(best.params)
    info["optimize"].update(params=params, search_throughput=best.user_attrs.get("throughput"),
                            description=best.user_attrs.get("description"), fp8_keep=best.user_attrs.get("fp8_keep"),
                            fp8_plans={pol: plan.summary() for pol, plan in tuner.fp8_plans.items()},
                            confirmation=study.user_attrs.get("confirmation"),
                            measured=sorted(((t.user_attrs.get("description", ""), round(t.user_attrs["throughput"], 1),
                                              t.user_attrs.get("max_rel_error")) for t in trials
                                             if t.state.name == "COMPLETE" and "throughput" in t.user_attrs),
                                            key=lambda x: -x[1]))
    torch._dynamo.reset()

    def rebuilt():
        cand = tuner.build(params, best.user_attrs.get("fp8_keep"))  # the graph the trial measured
        return wrap(cand.module, params.get("runtime", "eager"), inputs)

    measure(vname, rebuilt, kind="compile", limit_s=args.compile_budget, precision=params["precision"],
            extra=lambda: dict(info))
    release(device)


def selected(vname: str, args) -> bool:
    """Whether ``--variants`` (fnmatch patterns; empty: all) selects the variant ``vname``."""
    return not args.variants or any(fnmatch.fnmatchcase(vname, p) for p in args.variants)


def fp8_skip_reason(spec: ModelSpec, hw, args, capture_reason: str | None) -> str | None:
    """Why an FP8 variant does not run for this model, or None."""
    if capture_reason:
        return capture_reason
    if args.quick:
        return "--quick skips torch.compile variants"
    if spec.conv:
        return "conv net: FP8 here covers linears only"
    if "fp8" not in hw.tensor_core_precisions:
        return f"no FP8 Tensor Cores on {hw.arch}"
    return None


def finish(entry: dict, ceilings: dict) -> dict:
    """Fill the summary keys from the measured variants."""
    def ok(v: dict) -> bool:
        limit = MAX_ERROR_FP8 if v.get("precision") == "fp8" else MAX_ERROR
        return v.get("status") == "ok" and v.get("nonfinite", 1) == 0 and v.get("rel_l2_error", 1) <= limit

    variants = entry.get("variants", {})
    base = {k: v for k, v in variants.items() if v.get("kind") == "baseline" and ok(v)}
    tct = {k: v for k, v in variants.items() if v.get("kind") == "tctune" and ok(v)}
    bname = max(base, key=lambda k: base[k]["throughput"], default=None)
    fastest = max(tct, key=lambda k: tct[k]["throughput"], default=None)
    # tctune's headline is what `tctune optimize` chose (issue 4); the fastest fixed variant is reported beside
    tname = "tctune_optimize" if "tctune_optimize" in tct else fastest
    best_b = base[bname]["throughput"] if bname else None
    best_t = tct[tname]["throughput"] if tname else None
    prec = tct[tname]["precision"] if tname else None
    ceiling = ceilings.get(prec) if prec else None
    achieved = tct[tname].get("achieved_tflops") if tname else None
    summary = {
        "best_baseline_name": bname, "best_baseline": best_b,
        "tctune_name": tname, "tctune": best_t,
        "ratio": (best_t / best_b) if best_b and best_t else None,
        "max_rel_error": tct[tname]["rel_l2_error"] if tname else None,
        "achieved_tflops": achieved,
        "ceiling_tflops": ceiling,
        "ceiling_precision": prec,
        "fraction_of_ceiling": (achieved / ceiling) if achieved and ceiling else None,
    }
    if fastest:
        summary.update(fastest_variant_name=fastest, fastest_variant=tct[fastest]["throughput"],
                       fastest_variant_ratio=(tct[fastest]["throughput"] / best_b) if best_b else None,
                       fastest_variant_error=tct[fastest]["rel_l2_error"])
    return {**summary, **entry}


# ------------------------------------------------------------------------------------------------ output


def fmt(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def table(report: dict) -> str:
    head = (f"{'model':<11} {'best baseline':<15} {'items/s':>10} {'tctune':<24} {'items/s':>10} {'ratio':>6} "
            f"{'rel err':>8} {'TFLOP/s':>8} {'ceiling':>8}")
    lines = [head, "-" * len(head)]
    for name, m in report["models"].items():
        if m.get("error"):
            lines.append(f"{name:<11} {m['error'][:110]}")
            continue
        lines.append(f"{name:<11} {m['best_baseline_name'] or '-':<15} {fmt(m['best_baseline'], ',.0f'):>10} "
                     f"{m['tctune_name'] or '-':<24} {fmt(m['tctune'], ',.0f'):>10} {fmt(m['ratio'], '.2f'):>6} "
                     f"{fmt(m['max_rel_error'], '.1e'):>8} {fmt(m['achieved_tflops'], '.1f'):>8} "
                     f"{fmt(m['ceiling_tflops'], '.0f'):>8}")
    return "\n".join(lines)


def write(out_dir: Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "latest.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, out_dir / "latest.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (latest.json is written there)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated, from: %(default)s")
    p.add_argument("--quick", action="store_true", help="skip the torch.compile variants")
    p.add_argument("--dry-run", action="store_true", help="tiny configs on the CPU, to check the script")
    p.add_argument("--budget", type=float, default=390.0, help="seconds for the whole run (default %(default)s)")
    p.add_argument("--compile-budget", type=float, default=60.0,
                   help="seconds one torch.compile may take before it is abandoned (default %(default)s)")
    p.add_argument("--model-limit", default=None,
                   help="seconds per model, replacing the built-in limits (still capped by --budget): one number for "
                        "every model, or NAME=S pairs (e.g. gpt2=230,seed_cnn=70; unnamed models keep theirs)")
    p.add_argument("--policies", default="autocast,pure",
                   help="cast policies of the tctune graph's eager / CUDA-graph variants (default %(default)s)")
    p.add_argument("--variants", default="",
                   help="comma-separated fnmatch patterns of the variants to run (e.g. 'fp16_*,*fp8*'); the rest are "
                        "recorded as skipped (default: all)")
    p.add_argument("--optimize-trials", type=int, default=16,
                   help="trials of the tctune_optimize variant's search (default %(default)s, as tctune optimize)")
    p.add_argument("--optimize-budget", type=float, default=150.0,
                   help="seconds after which that search starts no new trial (default %(default)s)")
    p.add_argument("--debug", action="store_true", help="print tracebacks of failing variants")
    args = p.parse_args(argv)
    for opt, value in (("--budget", args.budget), ("--compile-budget", args.compile_budget),
                       ("--optimize-budget", args.optimize_budget), ("--optimize-trials", args.optimize_trials)):
        if not value > 0:
            p.error(f"{opt} must be positive, got {value:g}")
    args.variants = tuple(x.strip() for x in args.variants.split(",") if x.strip())
    known = BASELINES + TCTUNE
    unmatched = [v for v in args.variants if not any(fnmatch.fnmatchcase(k, v) for k in known)]
    if unmatched:
        p.error(f"--variants: {unmatched} match no variant; variants: {', '.join(known)}")
    args.policies = tuple(x.strip() for x in args.policies.split(",") if x.strip())
    if not args.policies or set(args.policies) - {"autocast", "pure"}:
        p.error(f"--policies: choose from autocast,pure (got {','.join(args.policies) or 'nothing'})")
    if args.model_limit is not None:
        try:
            if "=" in args.model_limit:
                limits = {k.strip(): float(v) for k, v in (x.split("=", 1) for x in args.model_limit.split(","))}
            else:
                limits = dict.fromkeys(MODELS, float(args.model_limit))
        except ValueError:
            p.error(f"--model-limit: expected seconds or NAME=S pairs, got {args.model_limit!r}")
        if set(limits) - set(MODELS):
            p.error(f"--model-limit: unknown model(s) {sorted(set(limits) - set(MODELS))}; models: {', '.join(MODELS)}")
        if any(not v > 0 for v in limits.values()):
            p.error("--model-limit must be positive")
        for m, v in limits.items():
            MODELS[m] = dataclasses.replace(MODELS[m], limit_s=v)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        p.error(f"--models: unknown {unknown or '(empty)'}; choose from {', '.join(MODELS)}")
    if not args.dry_run and not torch.cuda.is_available():
        print("suite: no CUDA GPU here; nothing measured (use --dry-run to check the script on the CPU)")
        return 0

    from tctune.hardware import resolve

    device = torch.device("cpu" if args.dry_run else "cuda:0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True  # every variant alike; the warm-up calls absorb the autotuning
    hw = resolve()
    if args.dry_run:  # plan for the H200's alignment so the padding passes have work on the CPU too
        with contextlib.suppress(Exception):
            hw = resolve("h200")
    clock = Clock(args.budget)
    out_dir = Path(args.out)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "hardware": hw.to_dict(),
        "dry_run": args.dry_run, "quick": args.quick,
        "max_error": MAX_ERROR, "budget_s": args.budget, "compile_budget_s": args.compile_budget,
        "protocol": ("tctune.measure.time_call: 2 warm-up calls, median of 5 repeats of ~0.05 s (CUDA events on a "
                     "GPU); cudnn.benchmark on; error: relative L2 vs FP32 eager (TF32 off) on the same seeded inputs; throughput in "
                     "items/s"),
        "models": {},
    }
    if args.dry_run:
        print("DRY RUN: tiny configs on the CPU to check the script; the numbers mean nothing (variant names keep "
              "their GPU meaning)", flush=True)
    t0 = time.perf_counter()
    n = 128 if args.dry_run else GEMM_N
    report["ceilings_tflops"] = gemm_ceilings(device, n)
    report["ceilings_tflops"]["shape"] = f"{n}x{n}x{n}"
    report["ceilings_tflops"]["wall_s"] = round(time.perf_counter() - t0, 1)
    print("GEMM ceiling TFLOP/s:", {k: v for k, v in report["ceilings_tflops"].items() if k != "errors"}, flush=True)
    write(out_dir, report)

    for i, name in enumerate(names):
        limit = clock.start_model(name, names[i:])
        print(f"{name}: time limit {limit:.0f} s", flush=True)
        if limit < MIN_LEFT_S["other"] * 2:
            report["models"][name] = finish({"error": f"skipped: {clock.left():.0f} s of --budget left",
                                             "variants": {}}, report["ceilings_tflops"])
        else:
            report["models"][name] = run_model(name, args, device, hw, clock, report["ceilings_tflops"])
            report["models"][name]["time_limit_s"] = round(limit, 1)
        report["wall_s"] = round(time.perf_counter() - _T_START, 1)
        write(out_dir, report)

    print()
    print(table(report))
    print(f"wrote {out_dir / 'latest.json'} ({report['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
