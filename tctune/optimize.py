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
import subprocess
import sys
from pathlib import Path

import optuna
import torch

from . import __version__
from .errors import ExportError, UsageError
from .hardware import HardwareSpec, resolve
from .modelfile import load_model_file
from .report import build_report, write_atomic, write_report
from .deploy import Artifacts, calibration_for, export_graphs
from .search import TuneConfig, Tuner, best_trial
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


def write_onnx_runners(tuner: Tuner, params: dict, artifacts: Artifacts, graph: torch.nn.Module) -> None:
    """A manifest and ``runner.py`` beside each ONNX file, so ``tctune bench`` and the runner can time it."""
    from .export.runner import describe_inputs, write_runner

    sizes = sorted(tuner.cfg.batch_sizes)
    for key, precision in (("onnx", params["precision"]), ("onnx_fp32", "fp32")):
        path = getattr(artifacts, key)
        if not path or (key == "onnx" and not artifacts.onnx_inputs):
            continue
        try:
            names = [i["name"] for i in artifacts.onnx_inputs]
            inputs = describe_inputs(graph, lambda b: tuner.mf.inputs(b, "cpu"), names, (2, 3))
            manifest = {"model": tuner.mf.name, "model_file": str(tuner.mf.path), "precision": precision,
                        "format": "onnx", "artifact": Path(path).name, "device": "cpu", "inputs": inputs,
                        "batch_sizes": {"min": sizes[0], "opt": params["batch_size"], "max": sizes[-1]},
                        "written_by": "tctune optimize"}
            if key == "onnx" and artifacts.onnx_note:
                manifest["note"] = artifacts.onnx_note  # e.g. FP8: static activation scales, how validated
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


def export_best(tuner: Tuner, params: dict, out: Path,
                fp8_keep: list[str] | None = None) -> tuple[Artifacts, list[dict]]:
    """Export the best configuration's graph (passes at its precision) to ONNX, and TensorRT if importable.

    At precision fp8, ``model.onnx`` is the bf16 graph with each FP8 linear as float8e4m3fn
    QuantizeLinear/DequantizeLinear (opset 19, :func:`tctune.export.export_onnx_fp8`): static per-tensor
    activation scales calibrated on the reference inputs of every searched batch size (the PyTorch graph's
    are dynamic per token), validated at batch 1, the tuned batch and one more; ``onnx_note`` and ``onnx_fp8`` say what was
    quantized and how it was validated, and ``model.fp32.onnx`` is written too when onnxruntime cannot run
    ``model.onnx`` itself.

    Args:
        fp8_keep: the FP8 keep-list the best trial was measured with (its ``fp8_keep`` user attribute), so the
            export is that graph even when this process planned none (a resumed study); None: ask the tuner.

    Returns:
        ``(artifacts, passes)``: the artifact paths/errors (``Artifacts.to_dict()`` is report.json's
        ``artifacts``) and the pass results (as dicts) for the report.
    """
    from .export import build_engine, export_onnx, export_onnx_fp8, tensorrt_available

    artifacts = Artifacts()
    if tuner.cfg.mode == "train":
        artifacts.onnx_error = artifacts.tensorrt_skipped_reason = "no engines in --mode train (engines are for inference)"
        return artifacts, []
    if not tuner.captured.ok:
        artifacts.onnx_error = f"not exported: the model could not be captured ({tuner.captured.reason})"
        artifacts.tensorrt_skipped_reason = "no ONNX to build from"
        return artifacts, []
    trial = tuner.trial_params(params, fp8_keep)
    calibration = [tuner.reference(trial.batch_size)[0]]
    _, measured = build_trial_graph(tuner.captured.graph_module, tuner.hw, trial, calibration)
    passes = [r.to_dict() for r in measured]  # what ran in the measured candidate, for the report
    if not trial.graph_passes:
        for p in passes:
            p["note"] = "the best trial ran the model as written; these are the passes its exported graph carries"
    export_precision = trial.precision
    graphs = export_graphs(tuner.captured.graph_module, tuner.hw, trial, calibration_for(trial, calibration[0]))
    fp8, g = graphs.fp8, graphs.onnx_graph
    if not tuner.cfg.export:
        artifacts.onnx_error = "export disabled (--no-export)"
        artifacts.tensorrt_skipped_reason = "export disabled (--no-export)"
        return artifacts, passes
    bs = params["batch_size"]
    check = (bs, 3 if bs != 3 else 5)
    try:
        if fp8 is not None:  # validated at batch 1 too, as `tctune export` does
            info = export_onnx_fp8(fp8.to(tuner.device), lambda b: tuner.mf.inputs(b, tuner.device), out / "model.onnx",
                                   batch_sizes=(1, *check), calibration=_fp8_calibration(tuner, calibration))
        else:
            info = export_onnx(g.to(tuner.device), lambda b: tuner.mf.inputs(b, tuner.device), out / "model.onnx",
                               batch_sizes=check)
        artifacts.update(info)
    except ExportError as exc:
        artifacts.onnx_error = str(exc)
        log.warning("ONNX export failed: %s", exc)
    if fp8 is not None:  # the FP8 errors come from an FP32 twin when onnxruntime cannot run model.onnx itself
        ort_ran_model = (artifacts.onnx_fp8 or {}).get("validated_on") == "model"
    else:
        ort_ran_model = artifacts.onnx_max_abs_error is not None
    if (artifacts.onnx and not ort_ran_model and export_precision in ("fp16", "bf16", "fp8")
            and not artifacts.onnx_fp32):  # FP8: the validated FP32 twin with the same Q/DQ is already kept
        # onnxruntime's CPU provider lacks many fp16/bf16 kernels: the typed model.onnx is for TensorRT or a GPU
        # provider. Also write the same graph in FP32 so there is an engine that runs (and is validated) anywhere.
        g32 = export_graphs(tuner.captured.graph_module, tuner.hw, trial.but(precision="fp32"), None).graph
        try:
            info32 = export_onnx(g32.to(tuner.device), lambda b: tuner.mf.inputs(b, tuner.device),
                                 out / "model.fp32.onnx", batch_sizes=check)
            artifacts.onnx_fp32 = info32["onnx"]
            artifacts.onnx_fp32_max_abs_error = info32["onnx_max_abs_error"]
            artifacts.onnx_fp32_error = info32.get("onnx_error")
        except ExportError as exc:
            artifacts.onnx_fp32_error = str(exc)
    write_onnx_runners(tuner, params, artifacts, g)
    ok, reason = tensorrt_available()
    if not artifacts.onnx:
        artifacts.tensorrt_skipped_reason = "no ONNX to build from"
    elif not ok:
        artifacts.tensorrt_skipped_reason = reason
    else:
        sizes = sorted(tuner.cfg.batch_sizes)
        shapes = {i["name"]: tuple(-1 if d == "batch" else d for d in i["shape"]) for i in (artifacts.onnx_inputs or [])}
        try:
            artifacts.update(build_engine(out / "model.onnx", out / "model.engine", input_shapes=shapes,
                                          batch_sizes=(sizes[0], bs, sizes[-1])))
        except ExportError as exc:
            artifacts.tensorrt_skipped_reason = f"TensorRT build failed: {exc}"
    return artifacts, passes


def optimize(model_path: str | Path, cfg: TuneConfig) -> dict:
    """Run the pipeline; returns the report dictionary (also written to ``cfg.out_dir``).

    Raises:
        ModelFileError, HardwareError, UsageError: bad input, before any trial runs.
    """
    mf = load_model_file(model_path)
    hw: HardwareSpec = resolve(cfg.target)
    devices = check_devices(cfg)
    workers: list[tuple[int, subprocess.Popen]] = []
    if len(devices) > 1:  # this process measures on the first GPU, one worker process on each other
        cfg = dataclasses.replace(cfg, trials=math.ceil(cfg.trials / len(devices)))
    device = torch.device(f"cuda:{devices[0]}") if devices else None
    if cfg.mode == "train":
        check_trainable(mf)  # before the model is built
    tuner = Tuner(cfg, mf, hw, device)  # its evaluator times training steps in --mode train
    out = check_out_dir(cfg.out_dir)  # after every input check: a rejected run leaves no empty folder
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
    study = tuner.run()
    worker_status = []
    for d, proc in workers:
        _, err = proc.communicate()
        worker_status.append({"device": d, "returncode": proc.returncode,
                              "error": err.strip().splitlines()[-1] if proc.returncode and err.strip() else None})
        if proc.returncode:
            log.warning("worker on GPU %d exited with %d: %s", d, proc.returncode, worker_status[-1]["error"])
    if cfg.worker:
        return {"worker": True, "study": study.study_name, "n_trials": len(study.trials)}
    study = optuna.load_study(study_name=study.study_name, storage=tuner.storage_url())
    bt = best_trial(study)
    artifacts = Artifacts()
    passes: list[dict] = []
    if bt is not None and tuner.interrupted:
        artifacts = Artifacts(onnx_error="not exported: the run was interrupted (run the command again to resume)",
                              tensorrt_skipped_reason="the run was interrupted")
    if bt is not None and not tuner.interrupted:
        params = dict(bt.params)
        if bt.user_attrs.get("model_cast") and "policy" in tuner.space():
            params["policy"] = "pure"  # the model cast as a whole won: its graph is the everything-low one
        artifacts, passes = export_best(tuner, params, out, fp8_keep=bt.user_attrs.get("fp8_keep"))
        trial = tuner.trial_params(params, bt.user_attrs.get("fp8_keep"))
        best_cfg = {"model": mf.name, "model_path": str(mf.path), "hardware": hw.to_dict(),
                    **trial.to_config(params), "batch_sizes": sorted(cfg.batch_sizes),
                    "throughput": bt.user_attrs.get("throughput"), "max_rel_error": bt.user_attrs.get("max_rel_error"),
                    "passes": [p["name"] for p in passes], "study": study.study_name, "tctune_version": __version__}
        write_atomic(out / "best_config.json", json.dumps(best_cfg, indent=2) + "\n")
        artifacts.best_config = str(out / "best_config.json")
    if cfg.storage is None:
        artifacts.study_db = str(out / "study.db")
    from .plots import write_plots
    plots = write_plots(study, out)
    report = build_report(
        study,
        hardware=hw.to_dict(),
        measured_on=measured_on(tuner.device),
        config=cfg.to_dict(),
        model={"name": mf.name, "path": str(mf.path), "tctune_version": __version__},
        passes=passes,
        artifacts=artifacts.to_dict(),
        capture={"ok": tuner.captured.ok, "reason": tuner.captured.reason},
        extra={"plots": plots, "workers": worker_status, "interrupted": tuner.interrupted,
               "fp8_plans": {policy: plan.to_dict() for policy, plan in tuner.fp8_plans.items()}},
    )
    write_report(report, out)
    return report
