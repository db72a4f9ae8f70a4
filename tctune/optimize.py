"""``tctune optimize``: the whole pipeline for one model file.

load model file → hardware spec → capture (torch.export) → Optuna study (each candidate measured against
FP32 eager) → export the best (ONNX, TensorRT where importable) → ``report.json`` / ``report.md`` /
``best_config.json``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import optuna
import torch

from . import __version__
from .errors import ERROR_LOG, ExportError, UsageError, append_error_log
from .hardware import HardwareSpec, resolve
from .measure import precision_mode
from .modelfile import ModelFile, load_model_file
from .report import build_report, write_atomic, write_report
from .deploy import (BF16_OUTPUTS_NOTE, Artifacts, as_written_export_graphs, cast_export_graphs, cast_onnx_out_dtype,
                     claim_batch_from, export_graphs, exports_as_written, smallest_batch)
from .search import TuneConfig, Tuner, best_trial, is_feasible
from .search.accuracy import check_score_options
from .search.autotune import autotune_report
from .search.baselines import run_params
from .search.loop import recorded_fp8
from .search.results import confirmed_throughputs, first_line
from .search.storage import StudyLock
from .search.train import check_trainable
from .trial import build_trial_graph

log = logging.getLogger("tctune")


def check_out_dir(out_dir: str | Path) -> Path:
    """Create ``out_dir`` and check it is writable.

    Raises:
        UsageError: it cannot be created or written.
    """
    p = Path(out_dir)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".tctune_write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        blocker = next((q for q in (p, *p.parents) if q.is_file()), None)
        what = (f"cannot be created: {blocker} is a file" if blocker is not None
                else f"is not writable ({exc.strerror or exc})")
        raise UsageError(f"out_dir {p} {what}\n  fix: an output folder you can write", field="out_dir") from exc
    return p


#: Files of an output folder that an export writes (``tctune optimize`` without ``--no-export``, ``tctune export``).
EXPORTED_PATTERNS = ("*.onnx", "*.onnx.data", "*.engine", "*.pt2", "*.manifest.json", "runner.py")


def warn_other_model(out: Path, mf: ModelFile, export: bool = True) -> str | None:
    """Warn (and return the warning) when ``out`` holds the report of another model (``report.json``'s model name
    or path differs from ``mf``'s): this run replaces that report and ``best_config.json``; exported files already
    in the folder (:data:`EXPORTED_PATTERNS`) are named: they stay, except those this run's export (``export``)
    writes under the same names (a runner beside them would time the other model). The other model's study stays
    in ``study.db``. Without ``export``, a folder holding this model's report and
    exported files (:data:`EXPORTED_PATTERNS`) gets a warning too: they are an earlier run's, and may not match
    the new ``best_config.json``. None otherwise (a new folder, this model's report and nothing stale)."""
    try:
        old = json.loads((out / "report.json").read_text()).get("model") or {}
    except (OSError, ValueError, AttributeError):
        return None
    name, path = old.get("name"), old.get("path")
    files = sorted({p.name for pattern in EXPORTED_PATTERNS for p in out.glob(pattern)})
    stale = files if not export else []
    same = name == mf.name and path == str(mf.path)  # this model's own folder (a resumed run)
    if name and same and stale:
        live = str(mf.path).startswith("<")  # a live module (tctune.optimize(model, ...)): no file to name
        fix = ("run with the export on" if live else
               f"rebuild them with `tctune export {shlex.quote(str(mf.path))} --config "
               f"{shlex.quote(str(out / 'best_config.json'))}`, or run with the "
               "export on")
        msg = (f"{out} holds exported files of an earlier run of {mf.name} ({', '.join(stale)}): this run exports "
               f"nothing, so they may not match the best_config.json it writes; {fix}")
        log.warning(msg)
        return msg
    if not name or same:
        return None
    msg = (f"{out} holds the report of another model, {name} ({path}): this run of {mf.name} replaces its "
           "report.md, report.json and best_config.json (its study stays in study.db)")
    if files:
        stay = ", as this run exports nothing" if not export else " unless this run's export writes the same names"
        msg += f"; the exported files there stay{stay}: {', '.join(files)}"
    msg += "; use another output folder to keep both"
    log.warning(msg)
    return msg


def measured_on(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)}), torch {torch.__version__}"
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads), torch {torch.__version__}"


def check_devices(cfg: TuneConfig) -> list[int]:
    """The GPU indices of ``--devices`` (empty without it, and in a worker, which sees one GPU).

    Raises:
        UsageError: no CUDA, or an index this machine does not have.
    """
    if not cfg.devices or cfg.worker:
        return []
    if not torch.cuda.is_available():
        raise UsageError("devices needs CUDA GPUs and torch sees none\n  fix: leave devices out to measure on this "
                         "machine's CPU", field="devices")
    n = torch.cuda.device_count()
    bad = [d for d in cfg.devices if d >= n]
    if bad:
        raise UsageError(f"devices {','.join(map(str, bad))}: this machine has GPUs 0..{n - 1}", field="devices")
    return list(cfg.devices)


def worker_config(cfg: TuneConfig, storage: str, index: int) -> TuneConfig:
    """The configuration worker process ``index`` runs: ``cfg``'s search on the shared study ``storage``, with its
    own sampler seed, no export, no report, no progress bar and no workers of its own."""
    return dataclasses.replace(cfg, storage=storage, worker=True, quiet=True, export=False, seed=cfg.seed + index,
                               devices=None)


def worker_command(model_path: str | Path, cfg: TuneConfig) -> list[str]:
    """The command line that starts a worker: ``tctune optimize`` receiving ``cfg`` serialized as JSON."""
    return [sys.executable, "-m", "tctune", "optimize", str(model_path), "--worker-config", cfg.to_json()]


def write_onnx_runners(tuner: Tuner, params: dict, artifacts: Artifacts, graph: torch.nn.Module,
                       key_graph: torch.nn.Module | None = None, fp8: bool = False) -> None:
    """A manifest and ``runner.py`` beside each ONNX file, so ``tctune bench`` and the runner can time it.

    ``model.onnx``'s manifest also carries the cache key ``tctune export`` checks
    (:func:`tctune.engines.artifact_cache_key` of ``key_graph``, the trial's export graph, :attr:`ExportGraphs.graph`;
    ``fp8``: the file is the FP8 Q/DQ ONNX) and the build's result, so the first ``tctune export`` of the same
    configuration reuses the file instead of rebuilding it. Its ``batch_sizes`` are those the file claims
    (``min``: ``artifacts.batch_range["min"]``) and was validated for, as ``tctune export`` writes them."""
    from .engines import _summary, artifact_cache_key, key_inputs
    from .export.runner import describe_inputs, write_runner

    sizes = sorted(tuner.cfg.batch_sizes)
    lo = (artifacts.details.get("batch_range") or {}).get("min") or sizes[0]
    claimed = {"min": lo, "opt": params["batch_size"], "max": sizes[-1]}
    for key, precision in (("onnx", params["precision"]), ("onnx_fp32", "fp32")):
        path = getattr(artifacts, key)
        if not path or (key == "onnx" and not artifacts.onnx_inputs):
            continue
        try:
            names = [i["name"] for i in artifacts.onnx_inputs]
            inputs = describe_inputs(graph, lambda b: tuner.mf.inputs(b, "cpu"), names, (2, 3))
            manifest = {"model": tuner.mf.name, "model_file": str(tuner.mf.path), "precision": precision,
                        "format": "onnx", "artifact": Path(path).name, "device": "cpu", "inputs": inputs,
                        "batch_sizes": claimed, "written_by": "tctune optimize"}
            if key == "onnx" and key_graph is not None:  # what `tctune export` checks before rebuilding model.onnx
                manifest["cache_key"] = artifact_cache_key(
                    key_graph, "onnx", precision=params["precision"], sizes=claimed, hw=tuner.hw, device=tuner.device,
                    inputs=key_inputs(key_graph, tuner.mf, sizes[-1]), fp8=fp8)
                manifest["result"] = _summary(artifacts.to_dict(), "onnx")
            if key == "onnx" and artifacts.onnx_note:
                manifest["note"] = artifacts.onnx_note  # e.g. FP8: static activation scales, how validated
            if artifacts.deploy is not None:  # which file to run where; the runner names it on a load failure
                manifest["deploy"] = artifacts.deploy
                manifest["deploy_reason"] = artifacts.deploy_reason
            if params["precision"] == "fp8" and artifacts.onnx_fp8:
                manifest["qdq"] = "float8e4m3fn"  # the runner then avoids onnxruntime's float8 Q/DQ fusions
            setattr(artifacts, f"{key}_runner", str(write_runner(path, manifest)))
        except Exception as exc:  # a runner is a convenience: never lose the run over it
            log.warning("no runner for %s: %s", path, exc)


def _fp8_calibration(tuner: Tuner, first: list[tuple]) -> list[tuple]:
    """Inputs for the FP8 ONNX activation scales: the reference inputs of every searched batch size.

    A static scale is max |x| / 448 over these; the tuned batch alone can be a handful of samples whose max
    misses the tail (seen: 4 samples put a layer's scale at 0.36 / 448 where 1.0 / 448 was needed, and the
    clipped model was 10% off instead of 4%). The search already drew (and cached) these inputs.
    """
    inputs = list(first)
    for b in sorted(set(tuner.cfg.batch_sizes)):
        try:
            candidate = tuner.reference(b)[0]
        except Exception as exc:  # e.g. the FP32 reference ran out of memory at that batch size
            log.debug("FP8 calibration skips batch %d: %s", b, exc)
            continue
        if not any(candidate is seen for seen in inputs):
            inputs.append(candidate)
    return inputs


def accuracy_extra(tuner: Tuner) -> dict:
    """``report.json``'s ``score`` (the score gate: FP32 score, rule, calls and seconds; absent without a score) and
    ``real_batches`` / ``real_batches_source`` (absent without real batches)."""
    ev = tuner.evaluator
    out: dict = {}
    gate = getattr(ev, "score_gate", None)
    if gate is not None:
        out["score"] = gate.to_dict()
    real = getattr(ev, "calibration", None)
    if real:
        out["real_batches"] = len(real)
        out["real_batches_source"] = tuner.cfg.calibration or "calibration_inputs()"
    return out


def fp32_export_graph(tuner: Tuner, trial) -> torch.nn.Module:
    """The FP32 graph of ``trial`` (its passes, :data:`~tctune.deploy.EXPORT_PIPELINE` at fp32) on the tuner's
    device: the twin ONNX written where onnxruntime cannot run the typed ``model.onnx``."""
    return export_graphs(tuner.captured.graph_module, tuner.hw, trial.but(precision="fp32"), None).graph.to(tuner.device)


def reference_bytes_per_item(tuner: Tuner, batch_size: int) -> float | None:
    """Bytes per batch item of the FP32 reference outputs (``tctune.export.onnx.output_nbytes``): those the
    evaluator computed at ``batch_size`` (cached since the trials), else at the first searched batch size whose
    reference runs; None when none does. Sizes the ONNX validation (``tctune.export.onnx.plan_validation``)."""
    from .export.onnx import output_nbytes

    for b in dict.fromkeys([batch_size, *sorted(tuner.cfg.batch_sizes)]):
        try:
            return output_nbytes(tuner.reference(b)[1]) / b
        except Exception as exc:  # noqa: BLE001 - e.g. the FP32 reference ran out of memory at that size
            log.debug("no reference outputs at batch %d to size the ONNX validation: %s", b, exc)
    return None


def run_as_written(tuner: Tuner, batch_size: int) -> None:
    """Run the FP32 model as written once on fresh inputs of ``batch_size`` (``mf.inputs``); raises where it fails."""
    with precision_mode("fp32"), torch.inference_mode():
        tuner.model(*tuner.mf.inputs(batch_size, tuner.device))


def batch_range_entry(tuner: Tuner, graph: torch.nn.Module, lo: int, note: str | None, validated) -> dict:
    """``report.json``'s ``artifacts.batch_range``: ``min`` (the smallest batch the engines claim,
    :func:`tctune.deploy.smallest_batch`: 1 where the model as written runs at 1), ``max`` (the largest searched
    batch size: the search ran it), ``graph_max`` (the largest batch the exported graph accepts, torch.export's
    bound; not run), ``validated`` (the batch sizes the ONNX validation ran) and ``note`` (why ``min`` is above
    1, or None)."""
    from .capture import batch_range

    return {"min": lo, "max": max(tuner.cfg.batch_sizes), "graph_max": batch_range(graph)[1],
            "validated": sorted(validated), "note": note}


#: ``onnx_note``'s sentence for an FP8 winner measured with ``torch._scaled_mm``'s fast accumulation.
FAST_ACCUM_ONNX_NOTE = ("The search measured FP8 GEMMs with fast accumulation (torch._scaled_mm use_fast_accum); "
                        "the ONNX Q/DQ graph has no such switch and TensorRT chooses its own accumulation, so an "
                        "engine's numerics and speed may differ from the measured graph's (AOTInductor keeps it).")


def export_best(tuner: Tuner, params: dict, out: Path,
                fp8_keep: list[str] | None = None, warn: bool = True,
                model_cast: bool = False, fp8_fast_accum: bool | None = None) -> tuple[Artifacts, list[dict]]:
    """Export the best configuration's graph (passes at its precision) to ONNX, and TensorRT if importable.

    When the best is a plain baseline that cast the model as a whole (``model_cast``: its ``model_cast`` user
    attribute; ``model.half()`` / ``model.to(torch.bfloat16)``, also through ``torch.compile``), ``model.onnx`` is
    that cast model's graph (:func:`tctune.deploy.cast_export_graphs`: every floating weight in the low dtype,
    inputs cast inside, no tctune pass; outputs per ``TuneConfig.output_dtype``, bf16 ones as FP32,
    :data:`tctune.deploy.BF16_OUTPUTS_NOTE`), and its FP32 twin is the captured FP32 model. When the best ran the
    model as written in FP32 (:func:`tctune.deploy.exports_as_written`: ``fp32_eager`` or its ``torch.compile``),
    ``model.onnx`` is the captured FP32 graph with no tctune pass (:func:`tctune.deploy.as_written_export_graphs`).
    ``artifacts.details["exported_graph"]`` names which (:data:`tctune.deploy.EXPORTED_GRAPHS`).

    At precision fp8, ``model.onnx`` is the bf16 graph with each FP8 linear as float8e4m3fn
    QuantizeLinear/DequantizeLinear (opset 19, :func:`tctune.export.export_onnx_fp8`): static per-tensor
    activation scales calibrated on the reference inputs of every searched batch size (the PyTorch graph's
    are dynamic per token), validated at the smallest claimed batch, the tuned batch and one more; ``onnx_note`` and ``onnx_fp8`` say what was
    quantized and how it was validated, and ``model.fp32.onnx`` is written too when onnxruntime cannot run
    ``model.onnx`` itself.

    Batch range: the files accept batch 1 and up only where the model as written runs at batch 1, else from the
    smallest searched batch size that runs (:func:`tctune.deploy.smallest_batch`; the graph's ``Dim("batch")``
    starts there, :func:`tctune.deploy.claim_batch_from`), and that smallest batch is validated beside the tuned
    one (``artifacts.batch_range``, :func:`batch_range_entry`).

    Validation is sized to memory (every file): the tuned batch is validated only when its reference outputs
    (:func:`reference_bytes_per_item`) are within ``tctune.export.onnx.plan_validation``'s limit, else the smallest
    claimed batch and a small one are; ``onnx_validation_batches`` (sorted ints) and ``onnx_validation_limited``
    (None, or the one line saying which batch was skipped and why) are in the artifacts' details.

    At other precisions, ``tctune.export.onnx.export_onnx_deployable`` writes ``model.onnx`` and, for a fp16/bf16
    graph that is not valid ONNX at any opset or that onnxruntime cannot run, ``model.fp32.onnx``: the trial's
    graph built at fp32 (:func:`fp32_export_graph`). ``deploy`` / ``deploy_reason`` (``tctune.export.onnx.deployment``)
    say which file to deploy on which runtime; they go into the runner manifests, and TensorRT is built from
    ``deploy["tensorrt"]``.

    Args:
        fp8_keep: the FP8 keep-list the best trial was measured with (its ``fp8_keep`` user attribute), so the
            export is that graph even when this process planned none (a resumed study); None: ask the tuner.
        fp8_fast_accum: the fast accumulation the best trial was measured with (its ``fp8_fast_accum`` user
            attribute; None: False with a recorded ``fp8_keep``, else ask the tuner). The PyTorch graph (and so an
            AOTInductor export) keeps it; the FP8 ONNX file cannot (Q/DQ has no accumulation switch; TensorRT
            chooses its own), and ``onnx_note`` says so when it was on.
        warn: log an ONNX export failure as a warning (False: at debug level, for a caller that reports it
            itself, as :func:`export_fallback` does).

    Returns:
        ``(artifacts, passes)``: the artifact paths/errors (``Artifacts.to_dict()`` is report.json's
        ``artifacts``) and the pass results (as dicts) for the report.
    """
    from .export import build_engine, export_onnx, export_onnx_fp8, tensorrt_available
    from .export.onnx import deployment, export_onnx_deployable, plan_validation

    artifacts = Artifacts()
    if tuner.cfg.mode == "train":
        artifacts.onnx_error = artifacts.tensorrt_skipped_reason = "no engines in --mode train (engines are for inference)"
        return artifacts, []
    if not tuner.captured.ok:
        artifacts.onnx_error = f"not exported: the model could not be captured ({tuner.captured.reason})"
        artifacts.tensorrt_skipped_reason = "no ONNX to build from"
        return artifacts, []
    trial = (tuner.trial_params(params, fp8_keep) if fp8_fast_accum is None else
             tuner.trial_params(params, fp8_keep, fp8_fast_accum))
    export_precision = trial.precision
    if model_cast:  # the model cast as a whole won: its graph, not tctune's graph at its precision
        if not tuner.cfg.export:
            artifacts.onnx_error = artifacts.tensorrt_skipped_reason = "export disabled (--no-export)"
            return artifacts, []
        graphs = cast_export_graphs(tuner.model, tuner.captured.graph_module, trial.precision,
                                    tuner.mf.inputs(2, tuner.device), tuner.cfg.output_dtype)
        passes: list[dict] = []
        fp32_twin = lambda: tuner.captured.graph_module  # noqa: E731 - the FP32 model it was cast from
        if cast_onnx_out_dtype(trial.precision, tuner.cfg.output_dtype) is not None and tuner.cfg.output_dtype == "compute":
            artifacts.details["onnx_outputs_note"] = BF16_OUTPUTS_NOTE
        exported_as = "model_cast"
    elif exports_as_written(trial):  # FP32 as written won (fp32_eager, its torch.compile): the model, no tctune pass
        graphs = as_written_export_graphs(tuner.captured.graph_module)
        passes = []
        fp32_twin = None  # not a typed graph: no twin
        exported_as = "model_as_written"
    else:
        calibration = tuner.evaluator.calibration_inputs(trial.batch_size)  # reference inputs, then real batches
        _, measured = build_trial_graph(tuner.captured.graph_module, tuner.hw, trial, calibration)
        passes = [r.to_dict() for r in measured]  # what ran in the measured candidate, for the report
        if not trial.graph_passes:
            for p in passes:
                p["note"] = "the best trial ran the model as written; these are the passes its exported graph carries"
        graphs = export_graphs(tuner.captured.graph_module, tuner.hw, trial, calibration if trial.calibration else None)
        fp32_twin = lambda: fp32_export_graph(tuner, trial)  # noqa: E731
        exported_as = "tctune_graph"
    fp8, g = graphs.fp8, graphs.onnx_graph
    if not tuner.cfg.export:
        artifacts.onnx_error = "export disabled (--no-export)"
        artifacts.tensorrt_skipped_reason = "export disabled (--no-export)"
        return artifacts, passes
    artifacts.details["exported_graph"] = exported_as
    bs = params["batch_size"]
    lo, lo_note = smallest_batch(lambda b: run_as_written(tuner, b), tuner.cfg.batch_sizes)
    for graph in (g, *((fp8.fp32, fp8.bf16, fp8.fp8) if fp8 is not None else ())):
        claim_batch_from(graph, lo)
    if lo > 1:
        twin = fp32_twin
        fp32_twin = lambda: claim_batch_from(twin(), lo)  # noqa: E731
        log.info("export: %s", lo_note)
    # the tuned batch and the smallest claimed one (the FP8 export validates at that one besides these two)
    second = (lo if lo != bs and fp8 is None else
              next(b for b in (3, 5, bs + 1, bs + 2) if b not in (bs, lo) and b >= lo))
    check, skipped = plan_validation((bs, second), reference_bytes_per_item(tuner, bs), smallest=lo)
    check = (check * 2)[:2]  # export_onnx takes two sizes (one when even batch 2's outputs are over the limit)
    validated = {lo, *check} if fp8 is not None else set(check)  # the FP8 export validates at the smallest too
    artifacts.update({"onnx_validation_batches": sorted(validated), "onnx_validation_limited": skipped,
                      "batch_range": batch_range_entry(tuner, g, lo, lo_note, validated)})
    if skipped:
        log.info("ONNX validation: %s", skipped)
    make_inputs = lambda b: tuner.mf.inputs(b, tuner.device)  # noqa: E731
    since = time.time()
    try:
        if fp8 is not None:  # validated at batch 1 too, as `tctune export` does
            info = export_onnx_fp8(fp8.to(tuner.device), make_inputs, out / "model.onnx",
                                   batch_sizes=(lo, *check), calibration=_fp8_calibration(tuner, calibration))
        else:
            typed = export_precision not in ("fp32", "tf32")  # tf32 is FP32 in an engine file
            info = export_onnx_deployable(g.to(tuner.device), make_inputs, out / "model.onnx",
                                          fp32_module=fp32_twin if typed else None,
                                          batch_sizes=check)
        artifacts.update(info)
    except ExportError as exc:
        from .engines import failed_format

        artifacts.onnx_error = str(exc)
        # recorded as `tctune export` records it: the full text (chained causes) in OUT/tctune_errors.log
        artifacts.onnx_failed = failed_format(out, "onnx", exc, out / "model.onnx", since)
        (log.warning if warn else log.debug)("ONNX export failed: %s (full text in %s)", first_line(exc),
                                             artifacts.onnx_failed["log"] or "no log: unwritable")
    if fp8 is not None:  # the FP8 errors come from an FP32 twin when onnxruntime cannot run model.onnx itself
        ort_ran_model = (artifacts.onnx_fp8 or {}).get("validated_on") == "model"
        if artifacts.onnx and not ort_ran_model and not artifacts.onnx_fp32:
            # onnxruntime's CPU provider lacks many low-precision kernels: the typed model.onnx is for TensorRT or a
            # GPU provider. Also write the same graph in FP32 so there is an engine that runs (and is validated).
            try:
                info32 = export_onnx(fp32_export_graph(tuner, trial), make_inputs, out / "model.fp32.onnx",
                                     batch_sizes=check)
                artifacts.update({"onnx_fp32": info32["onnx"], "onnx_fp32_max_abs_error": info32["onnx_max_abs_error"],
                                  "onnx_fp32_error": info32.get("onnx_error"),
                                  "onnx_fp32_load": info32.get("onnx_load"),
                                  "onnx_fp32_provider": info32.get("onnx_provider")})
            except ExportError as exc:
                artifacts.onnx_fp32_error = str(exc)
        artifacts.update(deployment(artifacts.to_dict()))
        if trial.fp8_fast_accum and artifacts.onnx:
            artifacts.onnx_note = " ".join(filter(None, (artifacts.onnx_note, FAST_ACCUM_ONNX_NOTE)))
    write_onnx_runners(tuner, params, artifacts, g, key_graph=graphs.graph.to(tuner.device), fp8=fp8 is not None)
    ok, reason = tensorrt_available()
    trt_source = (artifacts.deploy or {}).get("tensorrt")
    if not trt_source:
        artifacts.tensorrt_skipped_reason = ("no ONNX file valid for TensorRT" + (f" ({artifacts.deploy_reason})"
                                             if artifacts.deploy_reason else ""))
    elif not ok:
        artifacts.tensorrt_skipped_reason = reason
    else:
        sizes = sorted(tuner.cfg.batch_sizes)
        shapes = {i["name"]: tuple(-1 if d == "batch" else d for d in i["shape"]) for i in (artifacts.onnx_inputs or [])}
        from .export.tensorrt import profile_ranges

        ranges, _ = profile_ranges(tuner.captured.info()["dynamic"])  # the model's Dims beyond the batch
        try:
            artifacts.update(build_engine(out / trt_source, out / "model.engine", input_shapes=shapes,
                                          batch_sizes=(sizes[0], bs, sizes[-1]), dim_ranges=ranges))
        except ExportError as exc:
            artifacts.tensorrt_skipped_reason = f"TensorRT build failed: {first_line(exc)}"
    return artifacts, passes


#: After the best configuration fails to export, at most this many next-best feasible trials are tried.
FALLBACK_TRIES = 3


class PostStages:
    """Runs the stages after the trials (the finalists' re-measure, the side-by-side timing, the export, the plots)
    so that an exception in one is recorded, not fatal: the report is still written.

    Each failure becomes one ``post_errors`` entry ``{"stage", "error", "log"}`` (``error``: the exception's type
    and first line, at most 300 characters; ``log``: the path of :data:`ERROR_LOG` in the output folder, where
    the full text is appended; ``same_as``: the first stage that failed with the same ``error``, when one did)
    and one warning line on the console (none for a repeat of an earlier stage's error). A C++ backtrace (torch's ``Exception raised
    from ...`` frames) therefore reaches only the log file. KeyboardInterrupt and SystemExit pass through.
    """

    def __init__(self, out: Path):
        self.out = out
        self.errors: list[dict] = []

    @property
    def log_path(self) -> Path:
        return self.out / ERROR_LOG

    def record(self, stage: str, exc: BaseException) -> dict:
        """Record ``exc`` raised in ``stage``; returns its ``post_errors`` entry."""
        entry = {"stage": stage, "error": f"{type(exc).__name__}: {first_line(exc)}", "log": str(self.log_path)}
        first = next((e for e in self.errors if e["error"] == entry["error"]), None)
        if first is not None:  # the same text again (e.g. every fallback export): said once on the console
            entry["same_as"] = first["stage"]
        try:
            append_error_log(self.out, stage, exc)
        except OSError as err:  # the one line still reaches the report
            entry["log"] = None
            log.debug("cannot write %s: %s", self.log_path, err)
        self.errors.append(entry)
        if first is not None:
            log.debug("%s failed: the same error as %s", stage, first["stage"])
        else:
            log.warning("%s failed: %s (full text in %s)", stage, entry["error"], entry["log"] or "no log: unwritable")
        return entry

    def run(self, stage: str, fn, *args, default=None, **kwargs):
        """``fn(*args, **kwargs)``; on an exception, :meth:`record` it and return ``default``."""
        try:
            return fn(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 - recorded in the report, with the full text in the log file
            self.record(stage, exc)
            return default


def exported(artifacts: Artifacts) -> bool:
    """Whether an export wrote an ONNX file (the typed ``model.onnx`` or its FP32 twin)."""
    return bool(artifacts.onnx or artifacts.onnx_fp32)


def ranked_feasible(study: optuna.Study, objective: str) -> list[optuna.trial.FrozenTrial]:
    """The feasible trials, best first: by p99 latency (``objective="latency"``), else by throughput (the mean of
    the re-measured timings where the finalists were timed again)."""
    ok = [t for t in study.get_trials(deepcopy=False) if is_feasible(t)]
    if objective == "latency":
        return sorted(ok, key=lambda t: t.values[0])
    conf = confirmed_throughputs(study)
    return sorted(ok, key=lambda t: -conf.get(t.number, t.user_attrs["throughput"]))


def side_by_side_throughput(study: optuna.Study, number: int, run_id: str) -> float | None:
    """Items/s of trial ``number`` in run ``run_id``'s side-by-side timing (the median the report and the console
    quote), or None when that run did not time it side by side."""
    sbs = study.user_attrs.get("side_by_side") or {}
    if sbs.get("run_id") != run_id:
        return None
    return next((e.get("throughput") for e in sbs.get("entries") or [] if e.get("trial") == number), None)


def write_best_config(path: Path, tuner: Tuner, trial_attrs, passes: list[dict], study_name: str,
                      params: dict | None = None, side_by_side_throughput: float | None = None) -> None:
    """``best_config.json`` of a finished trial (what ``tctune export`` reads); ``params``: the parameters the
    export built (default: the trial's own). ``recommended`` says what the trial is: ``{"kind": "baseline" |
    "tctune", "name": the plain baseline's name or None, "trial": its number}`` (the same as ``report.json``'s
    ``best.kind`` / ``best.name`` when it is the recommended trial), plus ``label`` for a baseline (what a user
    calls it: ``"model.half() eager"``, ``"torch.compile(model.half())"``, ``tctune.search.baselines.baseline_label``).
    A trial that cast the model as a whole has ``model_cast: true`` (``tctune export`` then rebuilds the cast
    model's graph, :func:`tctune.deploy.cast_export_graphs`, with the file's ``output_dtype``).

    The other keys: ``model``, ``model_path``, ``hardware`` (``HardwareSpec.to_dict``), ``params`` (the searched
    parameters), ``fp8_keep`` (precision fp8 only: the exact keep-list), ``fp8_fast_accum`` (precision fp8 only:
    whether the FP8 GEMMs use ``torch._scaled_mm``'s fast accumulation), ``calibration`` (fp16 overflow
    calibration, :attr:`tctune.trial.TrialParams.calibration`: ``true`` keeps in FP32 each node of tctune's fp16
    graph whose FP32 activations exceed 65504 / 2 in absolute value (``passes.calibrate.overflow_nodes``) on the
    seeded reference inputs and the real batches; ``tctune export`` reruns that analysis on the same inputs, the
    real ones read again from ``calibration_folder`` or ``calibration_inputs()``; ``false`` casts those nodes
    too; no effect at other precisions or on the model as written; a search always writes ``true``),
    ``output_dtype``, ``batch_sizes`` (the searched ones, sorted), ``throughput`` (items/s, the trial's first
    timing), ``side_by_side_throughput`` (items/s, its median in this run's side-by-side timing, the number the
    report and the console quote; None when it was not timed side by side), ``max_rel_error``, ``passes``
    (names), ``study``, ``tctune_version``, ``calibration_folder``
    (``--calibration``'s folder as an absolute path, or None)."""
    from .search.baselines import baseline_label

    params = run_params(trial_attrs.params, trial_attrs.user_attrs) if params is None else params
    trial = tuner.trial_params(params, **recorded_fp8(trial_attrs))
    name = trial_attrs.user_attrs.get("baseline")
    recommended = {"kind": "baseline" if name else "tctune", "name": name, "trial": trial_attrs.number}
    if name:
        recommended["label"] = baseline_label(name)
    cast = {"model_cast": True} if trial_attrs.user_attrs.get("model_cast") else {}
    cfg = {"model": tuner.mf.name, "model_path": str(tuner.mf.path), "hardware": tuner.hw.to_dict(),
           "recommended": recommended, **trial.to_config(params), **cast,
           "output_dtype": tuner.cfg.output_dtype, "batch_sizes": sorted(tuner.cfg.batch_sizes),
           "throughput": trial_attrs.user_attrs.get("throughput"),
           "side_by_side_throughput": side_by_side_throughput,
           "max_rel_error": trial_attrs.user_attrs.get("max_rel_error"),
           "passes": [p["name"] for p in passes], "study": study_name, "tctune_version": __version__,
           "calibration_folder": (str(Path(tuner.cfg.calibration).expanduser().resolve())
                                  if tuner.cfg.calibration else None)}
    write_atomic(path, json.dumps(cfg, indent=2) + "\n")


def export_fallback(tuner: Tuner, study: optuna.Study, best, why: str, out: Path, stages: PostStages) -> dict:
    """Export the next-best feasible trial that exports, when the best one could not be exported.

    Tries at most :data:`FALLBACK_TRIES` trials in the order of :func:`ranked_feasible` (skipping the best),
    each into ``<out>/exportable_trial_<n>/`` (ONNX, runners, its own ``best_config.json``); an attempt that
    raises is recorded by ``stages`` (stage ``"export (fallback trial N)"``).

    Returns:
        ``report.json``'s ``artifacts.export_fallback``: ``{"best_trial": int, "best_error": str (why the best
        was not exported), "exported_trial": int or None, "params": dict or None, "throughput": float or None,
        "dir": str or None, "artifacts": dict or None, "tried": [trial numbers], "errors": [why each tried
        trial did not export] (only when none did)}``. A trial folder that did not export is removed (when this
        call created it).
    """
    result = {"best_trial": best.number, "best_error": why, "exported_trial": None, "params": None,
              "throughput": None, "dir": None, "artifacts": None, "tried": []}
    errors = []
    for t in [t for t in ranked_feasible(study, tuner.cfg.objective) if t.number != best.number][:FALLBACK_TRIES]:
        result["tried"].append(t.number)
        folder = out / f"exportable_trial_{t.number}"
        created = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        got = stages.run(f"export (fallback trial {t.number})", export_best, tuner, run_params(t.params, t.user_attrs), folder,
                         **recorded_fp8(t), warn=False,
                         model_cast=bool(t.user_attrs.get("model_cast")))
        if got is None or not exported(got[0]):
            errors.append(stages.errors[-1]["error"] if got is None else (got[0].onnx_error or "no ONNX file written"))
            if created:  # nothing usable in it: no empty or half-written folder is left behind
                shutil.rmtree(folder, ignore_errors=True)
            continue
        arts, passes = got
        stages.run(f"best_config.json (fallback trial {t.number})", write_best_config, folder / "best_config.json",
                   tuner, t, passes, study.study_name)
        arts.best_config = str(folder / "best_config.json")
        result.update(exported_trial=t.number, params=run_params(t.params, t.user_attrs), throughput=t.user_attrs.get("throughput"),
                      dir=str(folder), artifacts=arts.to_dict())
        log.warning("the best configuration (trial %d) could not be exported (%s); exported trial %d, the next best "
                    "that exports, to %s", best.number, why, t.number, folder)
        return result
    same = all(first_line(Exception(e)) == first_line(Exception(why)) for e in errors)
    said = any(e["error"] == why for e in stages.errors)  # already on the console as a failed stage
    log.warning("the best configuration (trial %d) could not be exported (%s), and none of the next %d feasible "
                "trials exported either%s", best.number, "the error above" if said else first_line(Exception(why)),
                len(result["tried"]),
                " (the same error)" if same and errors else (": " + "; ".join(dict.fromkeys(first_line(Exception(e))
                                                                                     for e in errors)) if errors else ""))
    result["errors"] = errors
    return result


def optimize(model_path: str | Path, cfg: TuneConfig) -> dict:
    """Run the pipeline; returns the report dictionary (also written to ``cfg.out_dir``).

    With the default SQLite study (no ``storage``) one run per output folder runs at a time
    (:class:`~tctune.search.storage.StudyLock`): a second one stops before it builds the model or touches the
    study. After the trials, the finalists' re-measure, the export and the plots each run guarded
    (:class:`PostStages`): an exception there is recorded in ``report.json``'s ``post_errors`` (full text in
    ``<out>/tctune_errors.log``) and the report is still written. When the best configuration cannot be
    exported, the next-best feasible trial that exports is written beside it (:func:`export_fallback`;
    ``artifacts.export_fallback`` names both). ``report.json`` / ``report.md`` are also written before each of
    these stages (and ``best_config.json`` before the export), so a process killed during one (the host's
    out-of-memory killer) leaves the report of the search: ``unfinished_stage`` names the stage (None in the
    final report) and ``artifacts.export`` is ``"in progress"`` until the export ran (then ``"finished"``).

    Raises:
        ModelFileError, HardwareError, UsageError: bad input, before any trial runs.
        StudyInUseError: another live run holds the output folder's study (a ``UsageError``).
    """
    return optimize_model(load_model_file(model_path), cfg).report


@dataclasses.dataclass
class Optimized:
    """What :func:`optimize_model` ran: the report, the tuner (its captured graph, FP32 model, reference inputs)
    and the best trial (None when nothing qualified, or in a worker process)."""

    report: dict
    tuner: Tuner
    best: optuna.trial.FrozenTrial | None = None


def optimize_model(mf: ModelFile, cfg: TuneConfig) -> Optimized:
    """The pipeline of :func:`optimize` for a loaded model file, or a ``ModelFile`` built from a live module
    (``ModelFile.from_module``). Writes the same files to ``cfg.out_dir``.

    Raises:
        ModelFileError, HardwareError, UsageError: bad input, before any trial runs.
        StudyInUseError: another live run holds the output folder's study (a ``UsageError``).
    """
    lock = StudyLock(cfg.out_dir) if cfg.storage is None and not cfg.worker else None
    if lock is not None:
        lock.check()  # a refused run costs nothing: before the model is built
    hw: HardwareSpec = resolve(cfg.target)
    devices = check_devices(cfg)
    if len(devices) > 1:  # this process measures on the first GPU, one worker process on each other
        cfg = dataclasses.replace(cfg, trials=math.ceil(cfg.trials / len(devices)))
    device = torch.device(f"cuda:{devices[0]}") if devices else None
    if cfg.mode == "train":
        check_trainable(mf)  # before the model is built
    check_score_options(mf, cfg)
    tuner = Tuner(cfg, mf, hw, device)  # its evaluator times training steps in --mode train
    out = check_out_dir(cfg.out_dir)  # after every input check: a rejected run leaves no empty folder
    if lock is not None:
        lock.acquire()  # before the study is opened; the --devices workers run under this lock
    if not cfg.worker:
        tuner.folder_warning = warn_other_model(out, mf, export=cfg.export)  # said in report.md too
    try:
        return _optimize(tuner, mf, hw, cfg, devices, out)
    finally:
        if lock is not None:
            lock.release()


def _optimize(tuner: Tuner, mf, hw: HardwareSpec, cfg: TuneConfig, devices: list[int], out: Path) -> "Optimized":
    workers: list[tuple[int, subprocess.Popen]] = []
    if len(devices) > 1:
        tuner.create_study()  # enqueue the baselines and fail interrupted trials once, before workers start
        for i, d in enumerate(devices[1:], start=1):
            cmd = worker_command(mf.path, worker_config(cfg, tuner.storage_url(), i))
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(d))
            log.info("worker on GPU %d: %d trials", d, cfg.trials)
            workers.append((d, subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
    cc = f", compute capability {hw.compute_capability}" if hw.compute_capability else ""
    log.info("hardware spec: %s (%s%s); measuring on %s; precisions %s", hw.name, hw.arch, cc,
             tuner.device, ", ".join(tuner.precisions))
    if not tuner.captured.ok:
        log.warning("graph passes disabled: %s", tuner.captured.reason)
    stages = PostStages(out)
    artifacts = Artifacts()
    passes: list[dict] = []
    plots: dict = {}
    worker_status: list[dict] = []
    export_state: str | None = None  # report.json's artifacts.export: "in progress", then "finished"

    def report_now(study_now: optuna.Study, unfinished: str | None) -> dict:
        """Build and write report.json / report.md from what is known now; ``unfinished``: the stage about to run
        (the report says it did not finish, in case the process ends during it), None for the final report."""
        arts = artifacts.to_dict()
        if export_state is not None:
            arts["export"] = export_state
        report = build_report(
            study_now,
            hardware=hw.to_dict(),
            measured_on=measured_on(tuner.device),
            config=cfg.to_dict(),
            model={"name": mf.name, "path": str(mf.path), "tctune_version": __version__,
                   "writes_buffers": tuner.written_buffers,
                   "output_folder_warning": tuner.folder_warning},
            passes=passes,
            artifacts=arts,
            capture=tuner.captured.info(),
            extra={"plots": plots, "workers": worker_status, "interrupted": tuner.interrupted,
                   "fp8_plans": {policy: plan.to_dict() for policy, plan in tuner.fp8_plans.items()},
                   "fp8_fast_accum": {policy: check.to_dict() for policy, check in
                                      getattr(tuner.evaluator, "fast_accum_checks", {}).items()},
                   "autotune": autotune_report(study_now, getattr(best_trial(study_now), "number", None)),
                   "post_errors": stages.errors, "unfinished_stage": unfinished, **accuracy_extra(tuner)},
        )
        write_report(report, out)
        return report

    def provisional(study_now: optuna.Study, stage: str) -> None:
        """The report as it stands before ``stage`` runs: a process killed during the stage (the host's out-of-memory
        killer, a time limit) still leaves a valid report of the search. Never fatal."""
        try:
            report_now(study_now, stage)
        except Exception as exc:  # noqa: BLE001 - the final report is still attempted
            log.debug("provisional report before %s not written: %s", stage, exc)

    if not cfg.worker:  # the finalists' re-measure and the side-by-side timing run inside tuner.run(): guard them
        remeasure, timing = tuner.confirm, getattr(tuner, "side_by_side", None)

        def guarded_confirm(study_now, *args, **kwargs):
            provisional(study_now, "re-measure")
            return stages.run("re-measure", remeasure, study_now, *args, **kwargs)

        def guarded_side_by_side(study_now, *args, **kwargs):
            provisional(study_now, "side-by-side timing")
            return stages.run("side-by-side timing", timing, study_now, *args, **kwargs)

        tuner.confirm = guarded_confirm
        finalist = getattr(tuner, "autotune", None)
        if finalist is not None:
            def guarded_autotune(study_now, *args, **kwargs):
                provisional(study_now, "max-autotune finalist")  # its compile can take minutes
                return stages.run("max-autotune finalist", finalist, study_now, *args, **kwargs)

            tuner.autotune = guarded_autotune
        if timing is not None:
            tuner.side_by_side = guarded_side_by_side
    study = tuner.run()
    for d, proc in workers:
        _, err = proc.communicate()
        worker_status.append({"device": d, "returncode": proc.returncode,
                              "error": err.strip().splitlines()[-1] if proc.returncode and err.strip() else None})
        if proc.returncode:
            log.warning("worker on GPU %d exited with %d: %s", d, proc.returncode, worker_status[-1]["error"])
    if cfg.worker:
        return Optimized({"worker": True, "study": study.study_name, "n_trials": len(study.trials)}, tuner)
    study = optuna.load_study(study_name=study.study_name, storage=tuner.storage_url())
    bt = best_trial(study)
    if cfg.storage is None:
        artifacts.study_db = str(out / "study.db")
    if bt is not None and tuner.interrupted:
        artifacts = Artifacts(onnx_error="not exported: the run was interrupted (run the command again to resume)",
                              tensorrt_skipped_reason="the run was interrupted",
                              study_db=artifacts.study_db)
        # The answer so far is recommended in the report: its best_config.json is written as in a finished run
        # (`tctune export` on it exports it), only the export itself is left to a resumed run.
        if stages.run("best_config.json", write_best_config, out / "best_config.json", tuner, bt,
                      list(bt.user_attrs.get("passes") or []), study.study_name, default=False,
                      params=run_params(bt.params, bt.user_attrs)) is not False:
            artifacts.best_config = str(out / "best_config.json")
    if bt is not None and not tuner.interrupted:
        params = run_params(bt.params, bt.user_attrs)  # its runtime as run (the max-autotune finalist's)
        # The search's answer is on disk before anything that can exhaust memory runs: best_config.json (with the
        # passes the trial measured; rewritten with the exported graph's after the export) and the report.
        sbs = side_by_side_throughput(study, bt.number, tuner.run_id)
        if stages.run("best_config.json", write_best_config, out / "best_config.json", tuner, bt,
                      list(bt.user_attrs.get("passes") or []), study.study_name, default=False,
                      params=params, side_by_side_throughput=sbs) is not False:
            artifacts.best_config = str(out / "best_config.json")
        export_state = "in progress"
        provisional(study, "export")
        got = stages.run("export", export_best, tuner, params, out, **recorded_fp8(bt),
                         warn=False,  # a failure is said once, by export_fallback
                         model_cast=bool(bt.user_attrs.get("model_cast")))  # model.half() won: its own graph
        best_config = artifacts.best_config
        if got is None:
            why = stages.errors[-1]["error"]
            artifacts = Artifacts(onnx_error=f"not exported: {why}", tensorrt_skipped_reason="no ONNX to build from")
            artifacts.onnx_failed = {"status": "failed", "error": why, "log": stages.errors[-1]["log"],
                                     "path": None, "files": []}
        else:
            artifacts, passes = got
            why = artifacts.onnx_error or "no ONNX file was written"
        if cfg.storage is None:
            artifacts.study_db = str(out / "study.db")
        artifacts.best_config = best_config
        artifacts.exported_trial = bt.number if exported(artifacts) else None
        if (not exported(artifacts) and cfg.export and cfg.mode != "train" and tuner.captured.ok):
            provisional(study, "export of the next-best trial")
            artifacts.export_fallback = export_fallback(tuner, study, bt, why, out, stages)
        export_state = "finished"
        if stages.run("best_config.json", write_best_config, out / "best_config.json", tuner, bt, passes,
                      study.study_name, default=False, params=params, side_by_side_throughput=sbs) is not False:
            artifacts.best_config = str(out / "best_config.json")
    from .plots import write_plots
    provisional(study, "plots")
    plots = stages.run("plots", write_plots, study, out, default={})
    report = report_now(study, None)
    return Optimized(report, tuner, bt if bt is not None and not tuner.interrupted else None)
