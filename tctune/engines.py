"""Deployable engines from a tuned configuration, and their timing (the library behind ``tctune export`` and
``tctune bench``).

:func:`export_artifacts` rebuilds the tuned graph of a model file from its ``best_config.json`` (capture with a
dynamic batch, then :func:`tctune.deploy.export_graphs` with the config's trial parameters: the graph the search
measured) and writes, per format:

- ONNX ``model.onnx``, validated by onnxruntime at batch 1, the tuned batch and the largest searched batch;
  a batch axis that froze to a constant fails the command. At precision fp8 every FP8 linear is written as
  float8e4m3fn QuantizeLinear/DequantizeLinear (opset 19, static per-tensor activation scales calibrated on
  the model file's example inputs; ``tctune.export.onnx_fp8``), everything else bf16;
- TensorRT ``model.engine`` (strongly typed, one profile min/opt/max = 1 / tuned / largest) where the
  ``tensorrt`` package is importable; otherwise the reason is given;
- AOTInductor ``model.pt2`` (dynamic batch), compared with PyTorch at two batch sizes; compiled with the Inductor
  options of the config's runtime (``tctune.runtime.aot_inductor_configs``: max-autotune's for
  ``inductor-max-autotune[-cudagraphs]``, recorded as ``aoti_inductor_configs``; Inductor's defaults otherwise);

each with ``<artifact>.manifest.json`` (inputs, shapes, dtypes, integer ranges, cache key) and a standalone
``runner.py``. An artifact whose manifest carries the same cache key is reused, not rebuilt.
:func:`bench_artifact` times any of them with the same code the generated runner uses.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from .errors import ExportError, UsageError, append_error_log, clip

log = logging.getLogger("tctune")

FORMATS = ("onnx", "tensorrt", "aoti")
#: Goes into the ONNX/TensorRT cache keys at precision fp8: what the FP8 ONNX holds (a bf16 export of the
#: same graph would otherwise share the key).
FP8_ONNX_SCHEME = "float8e4m3fn Q/DQ, static per-tensor activation scales, opset 19"
ARTIFACT_NAMES = {"onnx": "model.onnx", "tensorrt": "model.engine", "aoti": "model.pt2"}

# ------------------------------------------------------------------------------------------------ export


def read_config(path: str | Path) -> dict:
    """Load and check a ``best_config.json``.

    Returns:
        The config with ``params`` (``batch_size`` int, ``precision`` str, ``graph_passes`` bool) and
        ``batch_sizes`` (sorted list of ints; ``[batch_size]`` when the file predates that field).

    Raises:
        UsageError: the file is missing, not JSON, or lacks ``params.batch_size`` / ``params.precision``.
    """
    p = Path(path)
    fix = "  fix: pass the best_config.json that `tctune optimize` wrote (OUT/best_config.json)"
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"config not found: {p}\n{fix}") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read config {p}: {exc}\n{fix}") from None
    params = cfg.get("params") if isinstance(cfg, dict) else None
    if not isinstance(params, dict) or not isinstance(params.get("batch_size"), int) \
            or not isinstance(params.get("precision"), str):
        raise UsageError(f"{p} has no params.batch_size (int) and params.precision (str)\n{fix}")
    from passes import PRECISIONS

    if params["precision"] not in PRECISIONS:
        raise UsageError(f"{p}: params.precision {params['precision']!r} is not one tctune tunes "
                         f"({', '.join(PRECISIONS)})\n{fix}")
    if params["precision"] == "fp8" and params.get("graph_passes") is False:
        raise UsageError(f"{p}: precision fp8 needs tctune's graph (FP8 GEMMs are a graph rewrite), but "
                         f"params.graph_passes is false\n{fix}")
    keep = cfg.get("fp8_keep")
    if keep is not None and (not isinstance(keep, list) or not all(isinstance(k, str) and k for k in keep)):
        raise UsageError(f"{p}: fp8_keep must be a list of module-path patterns (as `tctune optimize` writes it), "
                         f"got {keep!r}\n{fix}")
    if not isinstance(cfg.get("fp8_fast_accum", False), bool):
        raise UsageError(f"{p}: fp8_fast_accum must be true or false (as `tctune optimize` writes it), "
                         f"got {cfg['fp8_fast_accum']!r}\n{fix}")
    sizes = cfg.get("batch_sizes") or [params["batch_size"]]
    if not isinstance(sizes, list) or not all(isinstance(b, int) and b >= 1 for b in sizes):
        raise UsageError(f"{p}: batch_sizes must be a list of positive ints, got {sizes!r}\n{fix}")
    cfg["batch_sizes"] = sorted(set(sizes) | {params["batch_size"]})
    return cfg


def check_config_model(cfg: dict, mf, config_path: str | Path) -> None:
    """Check that the config ``cfg`` (:func:`read_config`) was tuned for the model file ``mf`` (a ``ModelFile``).

    The config names its model by ``"model"`` (the model file's stem, as ``tctune optimize`` writes it) and
    ``"model_path"`` (the file tuned); it matches when that name, else the stem of ``model_path``, is ``mf.name``.
    A config naming neither is not checked. Folders are not compared: a tuned file may be moved or copied.

    Raises:
        UsageError: the config names another model (the message names both, and the fix).
    """
    tuned_for = cfg.get("model") or (Path(str(cfg["model_path"])).stem if cfg.get("model_path") else None)
    if not tuned_for or str(tuned_for) == mf.name:
        return
    where = f" ({cfg['model_path']})" if cfg.get("model_path") else ""
    raise UsageError(f"{config_path} was tuned for the model {tuned_for!r}{where}, not {mf.path.name}: its batch "
                     f"sizes and precision belong to that model\n  fix: pass the model file the config was tuned "
                     f"for, or run `tctune optimize {mf.path}` for a config of its own")


def config_target(cfg: dict) -> str | None:
    """The hardware to plan the passes for: the config's ``target``, else the GPU it was tuned on, else None."""
    if cfg.get("target"):
        return str(cfg["target"])
    hw = cfg.get("hardware") or {}
    if not isinstance(hw, dict):
        raise UsageError(f"the config's hardware must be the object `tctune optimize` wrote, got {hw!r}\n"
                         "  fix: remove it, or name the GPU with a \"target\" key (e.g. \"h100\" or \"sm_90\")")
    if hw.get("is_gpu") and hw.get("compute_capability"):
        return str(hw["compute_capability"])
    return None


def rebuild_graphs(mf, cfg: dict, hw, device) -> tuple["TrialParams", "ExportGraphs"]:
    """The graphs of the trial a ``best_config.json`` describes (:func:`read_config`), rebuilt the way the search
    built the graph it measured: capture at batch 2, then :func:`tctune.deploy.export_graphs` with the config's
    :class:`~tctune.trial.TrialParams` (precision, policy, FP8 keep-list) and, for a calibrated fp16 trial, the
    same seeded reference inputs at the tuned batch size (:func:`tctune.trial.reference_inputs`) followed by the
    real batches (the config's ``calibration_folder``, else the model file's ``calibration_inputs()``). A config
    with ``model_cast: true`` (a winning ``model.half()`` / ``model.to(torch.bfloat16)`` baseline) rebuilds the
    cast model's graph instead (:func:`tctune.deploy.cast_export_graphs`, outputs per the config's
    ``output_dtype``, ``"fp32"`` when absent); a trial that ran the model as written in FP32
    (:func:`tctune.deploy.exports_as_written`) rebuilds the captured FP32 graph, no tctune pass.

    Args:
        mf: the loaded model file; hw: the hardware planned for; device: where the model and inputs live.

    Raises:
        ExportError: the model could not be captured. PassError: a cast pass failed.
    """
    from .capture import capture
    from .deploy import calibration_for, export_graphs
    from .errors import CaptureError
    from .measure import precision_mode
    from .trial import TrialParams, reference_inputs

    trial = TrialParams.from_config(cfg)
    model = mf.model().eval().to(device)
    with precision_mode("fp32"):
        try:
            gm = capture(model, mf.inputs(2, device), mf.dynamic_shapes, mf.batched_mask())
        except CaptureError as exc:
            raise ExportError(f"cannot export {mf.path.name}: {exc}\n  fix: make the batch dimension dynamic in "
                              "forward (no hard-coded batch size in reshape/view/expand; use x.shape[0] or -1)") from exc
    if cfg.get("model_cast"):
        from .deploy import cast_export_graphs

        return trial, cast_export_graphs(model, gm, trial.precision, mf.inputs(2, device),
                                         cfg.get("output_dtype") or "fp32")
    from .deploy import as_written_export_graphs, exports_as_written

    if exports_as_written(trial):  # FP32 as written (fp32_eager won): the captured model, no tctune pass
        return trial, as_written_export_graphs(gm)
    inputs = reference_inputs(mf, trial.batch_size, device) if trial.calibration else None
    calibration = calibration_for(trial, inputs)
    if calibration and trial.precision == "fp16":  # the real batches the search calibrated with, too
        from .calibration import load_calibration

        real = load_calibration(mf, cfg.get("calibration_folder"), model, device)
        calibration += [b.inputs for b in real]
    return trial, export_graphs(gm, hw, trial, calibration)


def key_inputs(graph, mf, largest: int) -> list[dict]:
    """The inputs of ``graph`` as the cache keys and manifests of :func:`export_artifacts` describe them
    (``tctune.export.runner.describe_inputs``: name, shape with ``"batch"``, dtype, integer range; sampled at
    batch 2 and ``min(largest, 64)``); ``mf``: the model file (its ``inputs``)."""
    from .export.onnx import _input_names
    from .export.runner import describe_inputs

    names = _input_names(graph, len(mf.inputs(2, "cpu")))
    return describe_inputs(graph, lambda b: mf.inputs(b, "cpu"), names, (2, min(largest, 64)))


def artifact_cache_key(graph, fmt: str, *, precision: str, inputs: list[dict], sizes: dict[str, int], hw, device,
                       fp8: bool, digest: str | None = None, extra: dict | None = None) -> dict:
    """The cache key :func:`export_artifacts` gives the ``fmt`` file of ``graph`` (``tctune.export.cache.artifact_key``)
    and checks before rebuilding it; ``tctune optimize`` writes the same key into ``model.onnx``'s manifest, so
    the first ``tctune export`` after it reuses an unchanged file.

    Args:
        graph: the trial's export graph (:attr:`tctune.deploy.ExportGraphs.graph`, its batch claimed from
            ``sizes["min"]``, on ``device``); fmt: ``"onnx"``, ``"tensorrt"`` or ``"aoti"``; precision: the
            trial's; inputs: :func:`key_inputs`; sizes: ``{"min", "opt", "max"}`` batch sizes; hw: the hardware
            planned for; device: where the graph runs (a CUDA device's compute capability enters every key, the
            CPU's none); fp8: the ONNX is the FP8 Q/DQ file (:data:`FP8_ONNX_SCHEME` enters the ONNX and TensorRT
            keys); digest: ``graph_hash(graph)`` when computed; extra: anything else that shapes the file.
    """
    import torch

    from .export import cache

    cc = hw.compute_capability or None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        cc = f"{major}.{minor}"
    if fp8 and fmt in ("onnx", "tensorrt"):  # their file is the Q/DQ ONNX, not the _scaled_mm graph
        extra = {**(extra or {}), "fp8_onnx": FP8_ONNX_SCHEME}
    return cache.artifact_key(graph, fmt=fmt, precision=precision, inputs=inputs, batch_sizes=sizes,
                              compute_capability=cc if fmt != "onnx" or device.type == "cuda" else None,
                              graph_digest=digest, extra=extra)


def export_artifacts(model_file: str | Path, config_path: str | Path, formats=FORMATS,
                     out_dir: str | Path | None = None, *, force: bool = False) -> dict[str, Any]:
    """Rebuild the tuned graph of ``model_file`` from ``config_path`` and write the engines in ``formats``.

    The engines claim batch ``batch_sizes["min"]`` and up: 1 where the model as written runs at batch 1, else the
    smallest of the config's ``batch_sizes`` that runs (:func:`tctune.deploy.smallest_batch`; the graph's
    ``Dim("batch")`` starts there); the validations run at that batch, the tuned and the largest one (sized to
    memory).

    Returns:
        ``{"out": str, "model", "precision", "hardware", "batch_sizes": {"min", "opt", "max"}, "batch_range_note":
        why ``min`` is above 1 or None, "formats": {fmt: {"status": "built" | "reused" | "skipped" | "failed",
        "path", "manifest", "runner", "reason", "seconds", "files", ...build details}}}``. ``files``: every
        file this call wrote for the format (the artifact, its manifest, the FP32 twin ``model.fp32.onnx`` and
        its manifest when written, ``runner.py``; empty when reused). ``rebuilt`` (built only, when an artifact
        with another cache key was there): why it was not reused (:func:`tctune.export.cache.stale_reason`). A failed ONNX export or AOTInductor package
        does not stop the call: its entry has ``error`` (one line) and ``log`` (``out/tctune_errors.log``, holding
        the full traceback); TensorRT, which builds from the ONNX file, is then skipped with that reason.

    Raises:
        UsageError: bad config or formats, or a config tuned for another model (:func:`check_config_model`).
        ModelFileError: the model file breaks the contract.
        ExportError: capture failed (message: cause + fix). ONNX and AOTInductor failures (a frozen batch axis, a
            failed validation, an operator torch.onnx cannot export) are recorded per format instead.
    """

    from .deploy import claim_batch_from
    from .export import cache
    from .hardware import resolve
    from .modelfile import load_model_file
    from .trial import measuring_device

    cfg = read_config(config_path)
    formats = tuple(formats)
    mf = load_model_file(model_file)
    check_config_model(cfg, mf, config_path)
    out = Path(out_dir) if out_dir else Path(config_path).resolve().parent
    out.mkdir(parents=True, exist_ok=True)
    params = cfg["params"]
    precision, tuned = params["precision"], params["batch_size"]
    largest = max(cfg["batch_sizes"])
    hw = resolve(config_target(cfg))
    device = measuring_device()

    trial, graphs = rebuild_graphs(mf, cfg, hw, device)
    lo, lo_note = _smallest_batch(mf, device, cfg["batch_sizes"])
    for g in (graphs.graph, *((graphs.fp8.fp32, graphs.fp8.bf16, graphs.fp8.fp8) if graphs.fp8 is not None else ())):
        claim_batch_from(g, lo)
    fp8 = graphs.fp8.to(device) if graphs.fp8 is not None else None
    graph = graphs.graph.to(device)
    make_inputs = lambda b: mf.inputs(b, device)  # noqa: E731
    digest = cache.graph_hash(graph)
    sizes = {"min": lo, "opt": tuned, "max": largest}
    if lo_note:
        log.info("export: %s", lo_note)

    from .export.runner import write_runner

    inputs = key_inputs(graph, mf, largest)
    base = {"model": mf.name, "model_file": str(mf.path), "precision": precision, "graph_passes": params.get("graph_passes"),
            "hardware": hw.name, "inputs": inputs, "batch_sizes": sizes}
    results: dict[str, Any] = {}

    def cache_key(fmt: str, extra: dict | None = None) -> dict:
        return artifact_cache_key(graph, fmt, precision=precision, inputs=inputs, sizes=sizes, hw=hw, device=device,
                                  fp8=fp8 is not None, digest=digest, extra=extra)

    stale: dict[str, str | None] = {}  # why the artifact there before the build was not reused

    def reuse(fmt: str, key: dict) -> bool:
        path = out / ARTIFACT_NAMES[fmt]
        hit = None if force else cache.cached(path, key)
        if hit is None:
            # read before the build writes the new file: a file built now has no manifest until finish()
            stale[fmt] = None if force else cache.stale_reason(path, key)
            return False
        results[fmt] = {"status": "reused", "path": str(path), "manifest": str(path) + ".manifest.json",
                        "runner": str(out / "runner.py"), **(hit.get("result") or {}), "files": []}
        return True

    def finish(fmt: str, key: dict, info: dict, started: float, **manifest_extra) -> None:
        path = out / ARTIFACT_NAMES[fmt]
        if fmt == "onnx" and not info.get("onnx") and info.get("onnx_fp32"):  # typed graph not valid ONNX
            path = Path(info["onnx_fp32"])
            manifest_extra["precision"] = "fp32"
        manifest = {**base, "format": fmt, "artifact": path.name, **manifest_extra, "cache_key": key,
                    "result": info}
        runner = write_runner(path, manifest)
        if fmt == "onnx" and info.get("onnx_fp32") and Path(info["onnx_fp32"]) != path:
            # the FP32 twin (FP8: with the same Q/DQ), which onnxruntime's CPU provider runs
            twin = Path(info["onnx_fp32"])
            qdq = {"qdq": "float8e4m3fn"} if fp8 is not None else {}
            write_runner(twin, {**manifest, "artifact": twin.name, "precision": "fp32", **qdq})
        files = [str(path), str(path) + ".manifest.json"]
        if fmt == "onnx" and info.get("onnx_fp32") and Path(info["onnx_fp32"]) != path:
            files += [str(twin), str(twin) + ".manifest.json"]
        results[fmt] = {"status": "built", "path": str(path), "manifest": str(path) + ".manifest.json",
                        "runner": str(runner), "seconds": round(time.perf_counter() - started, 2), **info,
                        "files": files + [str(runner)], **({"rebuilt": stale[fmt]} if stale.get(fmt) else {})}

    onnx_inputs = None
    if "onnx" in formats or "tensorrt" in formats:
        key = cache_key("onnx")
        if not reuse("onnx", key):
            fp32_graph = None
            if fp8 is None and precision not in ("fp32", "tf32"):  # built only if onnxruntime cannot run model.onnx
                fp32_cfg = {**cfg, "params": {**params, "precision": "fp32"}, "calibration": False,
                            "model_cast": False}  # a cast model's twin: the FP32 graph
                fp32_graph = lambda: claim_batch_from(  # noqa: E731
                    rebuild_graphs(mf, fp32_cfg, hw, device)[1].graph.to(device), lo)
            since = time.time()
            try:
                onnx_inputs = _build_onnx(graph, make_inputs, out / ARTIFACT_NAMES["onnx"], (lo, tuned, largest),
                                          fp8=fp8, fp32_module=fp32_graph)
                started = time.perf_counter() - onnx_inputs.pop("_seconds")
                onnx_names = {i["name"] for i in onnx_inputs["onnx_inputs"]}
                finish("onnx", key, _summary(onnx_inputs, "onnx"), started, device="cpu",
                       inputs=[i for i in inputs if i["name"] in onnx_names] or inputs,
                       deploy=onnx_inputs.get("deploy"), deploy_reason=onnx_inputs.get("deploy_reason"))
            except Exception as exc:  # noqa: BLE001 - recorded: the formats that do not need it are still built
                results["onnx"] = _failed(out, "onnx", exc, out / ARTIFACT_NAMES["onnx"], since)
        if "onnx" not in formats:
            results["onnx"]["status"] += " (for tensorrt)"

    if "tensorrt" in formats:
        onnx_result = results.get("onnx") or {}
        source = (onnx_result.get("deploy") or {}).get("tensorrt")
        if onnx_result.get("status", "").startswith("failed"):
            skipped = {"status": "skipped", "reason": f"the ONNX export it builds from failed ({onnx_result.get('error')})"}
        else:
            skipped = (_build_tensorrt(out, inputs, sizes, cache_key("tensorrt"), finish, reuse, source=source)
                       if source or "deploy" not in onnx_result else
                       {"status": "skipped", "reason": "no ONNX file valid for TensorRT: "
                        + str(onnx_result.get("deploy_reason"))})
        if skipped is not None:
            results["tensorrt"] = skipped

    if "aoti" in formats:
        from .runtime import aot_inductor_configs

        # compiled as the measured candidate was: a max-autotune runtime's Inductor options (max_autotune, ...)
        configs = aot_inductor_configs(params.get("runtime", "eager"))
        key = cache_key("aoti", {"device": str(device), **({"inductor_configs": configs} if configs else {})})
        if not reuse("aoti", key):
            from .export.aoti import export_aoti
            from .export.onnx import plan_validation

            started, since = time.perf_counter(), time.time()
            try:
                check, limited = plan_validation((tuned, lo if tuned != lo else lo + 1),
                                                 _output_bytes_per_item(graph, make_inputs, lo), smallest=lo)
                if limited:  # its comparison holds float64 host copies of the outputs, as the ONNX validation does
                    log.info("AOTInductor validation: %s", limited)
                info = export_aoti(graph, make_inputs, out / ARTIFACT_NAMES["aoti"], (check * 2)[:max(2, len(check))],
                                   inductor_configs=configs or None)
                if configs:
                    info["aoti_inductor_configs"] = configs
                if info["aoti_error"]:
                    raise ExportError(f"the AOTInductor package {ARTIFACT_NAMES['aoti']} does not match PyTorch: "
                                      f"{info['aoti_error']}")
                info["aoti_validation_limited"] = limited
                finish("aoti", key, _summary(info, "aoti"), started, device=info["aoti_device"])
            except Exception as exc:  # noqa: BLE001 - recorded: the other formats' files stay reported
                results["aoti"] = _failed(out, "aoti", exc, out / ARTIFACT_NAMES["aoti"], since)
    return {"out": str(out), "model": mf.name, "precision": precision, "hardware": hw.name,
            "batch_sizes": sizes, "batch_range_note": lo_note, "formats": results}


def failed_format(out: Path, fmt: str, exc: BaseException, path: Path, since: float) -> dict[str, Any]:
    """The result entry of a format whose build raised ``exc``: ``status "failed"``, ``error`` (type and first
    line, at most 300 characters), ``log`` (``out/tctune_errors.log``, where the full traceback, chained causes
    included, was appended under the stage ``export <fmt>``; None when it cannot be written), ``path`` and
    ``files`` (``path`` when this build, started at wall-clock time ``since`` (Unix seconds), left it: a package
    kept unvalidated). ``tctune export`` and the export stage of ``tctune optimize`` both record a failure so."""
    error = f"{type(exc).__name__}: {clip((str(exc).strip().splitlines() or [''])[0])}"
    try:
        where = append_error_log(out, f"export {fmt}", exc)
    except OSError as err:
        log.debug("cannot write the error log in %s: %s", out, err)
        where = None
    left = path.exists() and path.stat().st_mtime >= since
    return {"status": "failed", "error": error, "log": where, "path": str(path) if left else None,
            "files": [str(path)] if left else []}


_failed = failed_format


def _smallest_batch(mf, device, searched) -> tuple[int, str | None]:
    """:func:`tctune.deploy.smallest_batch` of ``mf``'s FP32 model as written (built here, freed after)."""
    import torch

    from .deploy import smallest_batch
    from .measure import precision_mode

    model = mf.model().eval().to(device)

    def run(b: int) -> None:
        with precision_mode("fp32"), torch.inference_mode():
            model(*mf.inputs(b, device))

    try:
        return smallest_batch(run, searched)
    finally:
        del model


def _output_bytes_per_item(graph, make_inputs, batch: int = 1) -> float | None:
    """Bytes per item of ``graph``'s outputs at ``batch`` (``tctune.export.onnx.output_nbytes``), which size a
    validation (``plan_validation``); None when the graph does not run at ``batch`` here."""
    import torch

    from .export.onnx import output_nbytes

    try:
        with torch.no_grad():
            return float(output_nbytes(graph(*make_inputs(batch)))) / batch
    except Exception as exc:  # noqa: BLE001 - unknown size: plan_validation keeps to small batches
        log.debug("cannot size the validation at batch 1: %s", exc)
        return None


def _build_onnx(graph, make_inputs, path: Path, check: tuple[int, int, int], fp8=None, fp32_module=None) -> dict:
    """export_onnx_deployable at two of ``check`` and validate_onnx at the third; frozen/failed batches raise
    ExportError. ``fp32_module`` (the same graph at FP32, or a callable building it) becomes ``<stem>.fp32.onnx``
    where the typed file is not valid ONNX or onnxruntime cannot run it; the result's ``deploy`` /
    ``deploy_reason`` say which file to deploy on which runtime (``tctune.export.onnx.deployment``).

    With ``fp8`` (an ``FP8Graphs``), ``export_onnx_fp8`` writes the float8 Q/DQ model and validates it at all
    three batch sizes against the PyTorch FP8 graph (relative L2 <= 5e-2, else ExportError).

    Validation is sized to memory: a batch size of ``check`` whose outputs (measured at ``check[0]``, scaled by the
    batch) are over ``tctune.export.onnx.plan_validation``'s limit is replaced by a small one (not below
    ``check[0]``, the smallest batch the export claims); the result's
    ``onnx_validation_limited`` says which and why (None when every size was validated).
    """
    from .export.onnx import deployment, export_onnx_deployable, plan_validation, validate_onnx
    from .export.onnx_fp8 import export_onnx_fp8

    started = time.perf_counter()
    planned, limited = plan_validation(check, _output_bytes_per_item(graph, make_inputs, check[0]), smallest=check[0])
    if limited:
        log.info("ONNX validation: %s", limited)
    check = first, tuned, largest = (*planned, planned[-1], planned[-1])[:3]  # (1, t, t) validates 1 and t
    pair = (tuned, largest) if tuned != largest else (tuned, first if first != tuned else tuned + 1)
    if fp8 is not None:
        info = export_onnx_fp8(fp8, make_inputs, path, batch_sizes=tuple(dict.fromkeys((first, tuned, largest))))
    else:
        info = export_onnx_deployable(graph, make_inputs, path, fp32_module=fp32_module, batch_sizes=pair)
    extra = [b for b in dict.fromkeys(check) if b not in pair]
    if fp8 is None and extra and info.get("onnx") and info.get("onnx_error") is None:
        entries = validate_onnx(graph, make_inputs, path, extra)
        info["onnx_validation"] += entries
        errors = [e["error"] for e in entries if "error" in e]
        if errors:
            info["onnx_error"] = "; ".join(errors)
        measured = [e["max_abs_error"] for e in info["onnx_validation"] if e["max_abs_error"] is not None]
        info["onnx_max_abs_error"] = max(measured) if measured else None
    info.update(deployment(info))  # after the extra validation, which can fail the typed file
    err = info.get("onnx_error")
    if err and not info.get("onnx") and info.get("onnx_fp32") and not info.get("onnx_fp32_error"):
        log.warning("%s is not valid ONNX; its FP32 twin %s was written: %s", path.name,
                    Path(info["onnx_fp32"]).name, err)
    elif err:
        if "froze" in err or "not dynamic" in err:
            raise ExportError(f"{path.name}: {err}\n  fix: make the batch dimension dynamic in forward "
                              "(no hard-coded batch size in reshape/view/expand; use x.shape[0] or -1)")
        if "cannot load the model" in err:  # e.g. bf16 graph: no CPU kernel; the file is for TensorRT / a GPU EP
            log.warning("ONNX written but not validated here: %s", err)
        else:
            raise ExportError(f"{path.name} does not match PyTorch: {err}")
    info["onnx_validation_limited"] = limited
    info["_seconds"] = time.perf_counter() - started
    return info


def _build_tensorrt(out: Path, inputs: list, sizes: dict, key: dict, finish, reuse,
                    source: str | None = None) -> dict | None:
    """Build (or reuse) model.engine from ``source`` (the ONNX file the export's ``deploy["tensorrt"]`` names, in
    ``out``; default model.onnx); returns ``{"status": "skipped", "reason"}`` or None."""
    from .export import build_engine, tensorrt_available

    ok, reason = tensorrt_available()
    if not ok:
        return {"status": "skipped", "reason": reason}
    if reuse("tensorrt", key):
        return None
    started = time.perf_counter()
    shapes = {i["name"]: tuple(-1 if d == "batch" else int(d) for d in i["shape"]) for i in inputs}
    info = build_engine(out / (source or ARTIFACT_NAMES["onnx"]), out / ARTIFACT_NAMES["tensorrt"], input_shapes=shapes,
                        batch_sizes=(sizes["min"], sizes["opt"], sizes["max"]),
                        timing_cache=out / "tensorrt.timing_cache")
    if not info.get("tensorrt"):
        return {"status": "skipped", "reason": info.get("tensorrt_skipped_reason")}
    finish("tensorrt", key, info, started, device="cuda")
    return None


def _summary(info: dict, prefix: str) -> dict:
    """The JSON-ready subset of a build result kept in the manifest."""
    keep = {"onnx": ("onnx", "onnx_opset", "onnx_max_abs_error", "onnx_validation", "onnx_error", "onnx_dynamic",
                     "onnx_export_s", "onnx_outputs", "onnx_note", "onnx_fp8", "onnx_fp32", "onnx_fp32_max_abs_error",
                     "onnx_fp32_error", "onnx_load", "onnx_provider", "deploy", "deploy_reason",
                     "onnx_fp32_validation", "onnx_validation_limited"),
            "aoti": ("aoti_device", "aoti_export_s", "aoti_compile_s", "aoti_validation", "aoti_max_abs_error",
                     "aoti_error", "aoti_validation_limited", "aoti_inductor_configs")}[prefix]
    return {k: info.get(k) for k in keep}


# ------------------------------------------------------------------------------------------------ bench


def bench_artifact(artifact: str | Path, batch: int | None = None, iters: int = 50, warmup: int = 10,
                   provider: str | None = None, timing: str | None = None) -> dict:
    """Time one artifact with the generated runner's code (``tctune/export/_runner_template.py``).

    Args:
        timing: ``"device-resident"`` (inputs copied to the GPU once, outputs left there, each call the engine's
            synchronized run: onnxruntime IO binding on the CUDA provider, TensorRT ``execute_async_v3``,
            AOTInductor on CUDA tensors; how the search times candidates), ``"host-copies"`` (numpy in and out on
            every call) or None: device-resident where the engine runs on a GPU. On the CPU both are the same
            measurement (``timing_note`` says so).

    Returns:
        ``{artifact, format, device, batch_size, timing, timing_note, iters, warmup, latency_ms, latency_p90_ms,
        latency_mean_ms, throughput}`` (ms per call; items/s; ``timing``: ``"device-resident"`` or
        ``"host-copies"``, ``timing_note``: None or one line).

    Raises:
        UsageError: the artifact or its manifest is missing, or a bad ``--batch``/``--iters``.
        ExportError: its runtime is missing (e.g. TensorRT for ``.engine``) or fails to load it.
    """
    from .export import _runner_template as rt

    path = Path(artifact)
    if not path.exists():
        raise UsageError(f"artifact not found: {path}\n  fix: pass a file written by `tctune export`")
    if path.suffix not in rt.LOADERS:
        raise UsageError(f"{path.name}: unknown artifact type {path.suffix!r}\n  fix: pass a .onnx, .engine or .pt2 file")
    if not Path(rt.manifest_path(str(path))).exists():
        raise UsageError(f"{path.name} has no manifest ({path.name}.manifest.json) with its input shapes\n"
                         "  fix: write it with `tctune export MODEL_FILE --config best_config.json`")
    if iters < 1 or warmup < 0:
        raise UsageError(f"iters must be >= 1 and warmup >= 0, got {iters} and {warmup}", field="iters")
    try:
        return rt.time_artifact(str(path), batch, iters, warmup, provider, timing=timing)
    except rt.RunnerError as exc:
        fix = ("\n  fix: bench it on a machine with TensorRT and a GPU, or bench the .onnx file"
               if path.suffix == ".engine" else "")
        if path.suffix == ".onnx" and any(w in str(exc).lower() for w in ("bfloat16", "float16", "float8")):
            twin = path.with_name(path.stem + ".fp32.onnx")
            fix = ("\n  fix: onnxruntime's CPU provider lacks kernels for this precision; bench it with "
                   "--provider CUDAExecutionProvider on a GPU, or TensorRT"
                   + (f", or bench {twin.name} (the same graph in FP32) here" if twin.exists() else ""))
        raise ExportError(f"cannot time {path.name}: {exc}{fix}") from exc
