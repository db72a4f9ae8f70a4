"""tctune from Python: :func:`optimize` a live ``nn.Module`` (or a model file) and get a tuned module back.

::

    import tctune
    tuned = tctune.optimize(model, (x,), trials=16)     # the search `tctune optimize` runs
    y = tuned(x)                                        # the winning graph, precision and runtime
    tctune.save(tuned, "model.pt2")                     # one file: graph (tuned dtypes) + manifest
    tuned = tctune.load("model.pt2")                    # in any process, without the model's code

    enc = tokenizer(texts, return_tensors="pt")         # inputs by forward's argument names (any Mapping)
    tuned = tctune.optimize(model, enc)                 # taken in forward's parameter order
    y = tuned(**enc)                                    # and by the same names

The keyword options are the ``tctune optimize`` flags with ``_`` for ``-`` (:data:`OPTIONS`).
"""
from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import TctuneError, UsageError

log = logging.getLogger("tctune")

#: Keyword options of :func:`optimize`: the ``tctune optimize`` long flags (``--batch-sizes`` → ``batch_sizes``),
#: mapped to the ``TuneConfig`` field each sets.
OPTIONS = {"out": "out_dir", "batch_sizes": "batch_sizes", "trials": "trials", "timeout": "timeout_s",
           "max_error": "max_error", "max_error_fp8": "max_error_fp8", "mode": "mode",
           "effective_batch": "effective_batch", "objective": "objective", "max_latency_ms": "max_latency_ms",
           "max_memory_mib": "max_memory_mib", "fp8_keep": "fp8_keep", "target": "target", "storage": "storage",
           "devices": "devices", "seed": "seed", "runtimes": "runtimes", "compile_budget": "compile_budget_s",
           "no_prune": "prune", "no_export": "export", "quiet": "quiet",
           "min_score_ratio": "min_score_ratio", "min_score": "min_score", "max_mismatch_rate": "max_mismatch_rate",
           "output_dtype": "output_dtype", "fp8_fast_accum": "fp8_fast_accum", "autotune": "autotune"}
#: Keyword options of :func:`optimize` that are not flags: the live module's contract and the tuned module.
API_OPTIONS = ("score", "calibration", "dynamic_shapes", "name", "keep_low_precision_outputs")


def _fp8_keep(value) -> tuple[str, ...] | None:
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, str):
        if value.strip().lower() == "none":
            return ()
        return tuple(p.strip() for p in value.split(",") if p.strip())
    return tuple(value)


def _names(value) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return tuple(x.strip() for x in value.split(",") if x.strip())
    return tuple(value)


def _batch_sizes(value) -> tuple:
    """``batch_sizes=`` as the command's ``--batch-sizes`` takes it (a string: ``"8,32"``, ``"16-64"``, parsed by
    the command's own parser, whose message names a bad item), or an int, or a sequence of ints."""
    if isinstance(value, str):
        from .cli.common import parse_batch_sizes

        try:
            return parse_batch_sizes(value)
        except UsageError as exc:  # the parser names the flag; the option is this field
            exc.field = exc.field or "batch_sizes"
            raise
    return (value,) if isinstance(value, int) else tuple(value)


def api_words(text: str) -> str:
    """``text`` (a line the library logs or prints, which names ``tctune optimize``'s flags) in the terms of
    :func:`optimize`: each flag of an :data:`OPTIONS` keyword written as the keyword (``--batch-sizes`` →
    ``batch_sizes``; a switch as ``no_export=True``; a flag followed by a quoted value as the keyword argument,
    ``--batch-sizes '8,,32'`` → ``batch_sizes='8,,32'``); other text unchanged."""
    import re

    def keyword(m: re.Match) -> str:
        key = m.group(1).replace("-", "_")
        if key not in OPTIONS:
            return m.group(0)
        if m.group(2):  # a quoted value: the keyword argument as the caller wrote it
            return f"{key}={m.group(2).lstrip()}"
        return f"{key}=True" if key in ("no_prune", "no_export", "quiet") else key

    return re.sub(r"(?<![\w-])--([a-z][a-z0-9-]*)( (?:'[^'\n]*'|\"[^\"\n]*\"))?", keyword, text)


#: ``TuneConfig`` field -> the :func:`optimize` keyword that sets it, where the two differ (``timeout_s`` ->
#: ``timeout``): the inverse of :data:`OPTIONS` without the switches (``no_export`` sets ``export`` negated).
KEYWORDS = {field: key for key, field in OPTIONS.items() if key != field and not key.startswith("no_")}


def api_message(exc: BaseException) -> str:
    """``exc``'s message in :func:`optimize`'s terms: a ``UsageError``'s field (``exc.field``, a ``TuneConfig``
    field such as ``timeout_s``) written as the keyword that sets it (``timeout``, :data:`KEYWORDS`), and every
    flag written as its keyword (:func:`api_words`). The API's counterpart of the command's
    ``tctune.cli.common.flag_message``."""
    import re

    text = str(exc)
    field = getattr(exc, "field", None)
    if field in KEYWORDS:
        text = re.sub(rf"(?<![\w-]){re.escape(field)}(?!\w)", KEYWORDS[field], text)
    return api_words(text)


class _ApiWords(logging.Filter):
    """Rewrites the records of tctune's logger with :func:`api_words` while :func:`optimize` runs."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = api_words(record.getMessage()), None
        return True


def _in_api_words(run: Callable[[], Any], quiet: bool = False) -> Any:
    """``run()`` with tctune's log lines in the API's terms (:class:`_ApiWords`), shown on stderr as the command
    shows them unless the caller configured logging (:func:`tctune.console.console_log`; ``quiet``: warnings
    only, like ``--quiet``)."""
    from .console import console_log

    words = _ApiWords()
    log.addFilter(words)
    try:
        with console_log(quiet):
            return run()
    finally:
        log.removeFilter(words)


def check_option_names(options: dict, accepted: tuple[str, ...] = ()) -> None:
    """Raise one ``TypeError`` for the keywords in ``options`` that are neither in :data:`OPTIONS` nor in
    ``accepted``, naming each with the closest valid keyword (``trails`` → ``did you mean 'trials'?``) and listing
    the valid ones.

    Raises:
        TypeError: an unknown keyword.
    """
    from .errors import did_you_mean

    valid = [*OPTIONS, *API_OPTIONS]
    unknown = sorted(set(options) - set(OPTIONS) - set(accepted))
    if unknown:
        named = ", ".join(k + did_you_mean(k, valid) for k in unknown)
        raise TypeError(f"tctune.optimize() got unknown option(s) {named}; valid: {', '.join(valid)}")


def tune_config(options: dict, *, out_dir: str | Path, batch_sizes: tuple[int, ...] | None = None):
    """The ``TuneConfig`` of :func:`optimize`'s keyword ``options`` (:data:`OPTIONS`); ``out_dir`` and
    ``batch_sizes`` are the defaults when the options leave them out.

    Raises:
        TypeError: an unknown keyword (the message lists the valid ones).
        UsageError: a value out of range (``err.field`` names the ``TuneConfig`` field).
    """
    from .search import TuneConfig

    check_option_names(options)
    kw: dict[str, Any] = {"out_dir": str(out_dir)}
    if batch_sizes is not None:
        kw["batch_sizes"] = tuple(batch_sizes)
    for key, value in options.items():
        field = OPTIONS[key]
        if key in ("no_prune", "no_export"):
            value = not value
        elif key == "out":
            value = str(value)
        elif key == "batch_sizes":
            value = _batch_sizes(value)
        elif key == "devices":
            value = None if value is None else ((value,) if isinstance(value, int) else tuple(value))
        elif key == "runtimes":
            value = _names(value)
        elif key == "fp8_keep":
            value = _fp8_keep(value)
        kw[field] = value
    return TuneConfig(**kw)


def optimize(model, example_inputs=None, /, **options):
    """Tune ``model`` by measuring (the search ``tctune optimize`` runs) and return the tuned module.

    Args:
        model: an ``nn.Module`` (left in eval mode on the measuring device: ``cuda:0`` when torch sees a GPU,
            else the CPU; a winning "model as written" configuration runs this very object), or the path of a
            model file.
        example_inputs: for a module (positionally, or as ``example_inputs=``): a tuple of example tensors (a
            tensor alone is a 1-tuple), or a callable
            ``batch_size -> tuple of tensors`` (fresh random data, never all zeros). A mapping of ``forward``'s
            argument names to tensors, given or returned by the callable (``{"input_ids": ids,
            "attention_mask": mask}``, a Hugging Face tokenizer's ``BatchEncoding`` with ``return_tensors="pt"``),
            is taken by name: its tensors in the order of ``forward``'s parameters, as ``model(**inputs)`` would
            bind them; they must be ``forward``'s first parameters, none skipped
            (``tctune.modelfile.mapping_inputs``), and the tuned module takes them by the same names
            (``tuned(**inputs)``). From a tuple (or mapping), the batch
            sizes searched default to its batch (dim 0 of its first tensor), and the inputs of another
            batch size repeat or cut its rows along dim 0 (``tctune.modelfile.resize_batch``); from a callable
            they default to 8, 32, 128 as on the command line. For a model file: leave it out (the file
            defines ``example_inputs``), or pass a ``TuneConfig`` to get the report dictionary as before.
        **options: the ``tctune optimize`` long flags with ``_`` (:data:`OPTIONS`): ``out`` (the folder for the
            report, study and ONNX files; default: a new folder ``tctune_<name>_*`` in the system's temporary
            folder for a module, named in a warning and never removed, ``tctune_out/<stem>`` for a file),
            ``batch_sizes`` (int, sequence of ints, or a string as ``--batch-sizes`` takes it: ``"8,32"``,
            ``"16-64"``), ``trials``, ``timeout`` (s), ``max_error``, ``max_error_fp8`` (relative L2 error limits
            against the FP32 reference, fractions below 1: ``0.02`` is 2 %), ``objective``,
            ``max_latency_ms``, ``max_memory_mib``, ``fp8_keep`` (``"auto"``, ``"none"``, patterns),
            ``fp8_fast_accum`` (``"auto"``, ``"on"``, ``"off"``), ``autotune`` (``"auto"``, ``"on"``,
            ``"off"``: the max-autotune finalist, ``TuneConfig.autotune``; it needs ``"inductor"`` in
            ``runtimes``, e.g. ``runtimes="eager,inductor"`` on a CPU), ``target``,
            ``storage``, ``devices`` (one GPU for a live module), ``seed``, ``runtimes`` (names or a comma
            list), ``compile_budget`` (s), ``no_prune``, ``no_export``, ``quiet``, ``mode``; and
            ``min_score_ratio``, ``min_score``, ``max_mismatch_rate``, ``output_dtype`` (``"compute"``, the
            default: floating outputs in the winner's compute precision, as ``model.half()`` returns them, for
            the timed candidates, the plain baselines and the returned module alike; ``"fp32"``: the FP32
            model's dtypes); ``score`` (``score(model) -> float``,
            higher is better), ``calibration`` (real input batches: an iterable of input tuples (or mappings by
            argument name, as ``example_inputs``), a callable returning one, or a folder of ``.safetensors`` /
            ``.npz`` files like ``--calibration``: the folder also with a model file path, whose own batches are
            its ``calibration_inputs()``) and
            ``dynamic_shapes`` as in the model-file contract, ``name`` (the report's model name; default the
            class name), ``keep_low_precision_outputs`` (the older spelling of ``output_dtype``: True is
            ``"compute"``, False ``"fp32"``; giving both with different meanings raises ``UsageError``).

    Returns:
        A :class:`tctune.tuned.TunedModule` running the winning configuration, with ``.report`` (the
        ``report.json`` dictionary, also written to ``out``), ``.config`` (``TrialParams``) and ``.out_dir``
        (the folder the search wrote to: ``out``, or the temporary folder chosen for it); unless ``quiet``,
        the winner summary ``tctune optimize`` prints (:func:`tctune.report.console_summary`) is printed to stdout
        first. With a model path and a ``TuneConfig``: the report dictionary (the command line's call, which
        prints the summary itself).

    Raises:
        TypeError: an unknown option.
        UsageError: an option out of range (e.g. ``max_error=2``: the message suggests ``0.02``);
            ``mode="train"`` or several ``devices`` with a live module;
            ``min_score`` or ``min_score_ratio`` without ``score``; no configuration qualified.
        ModelFileError: ``model`` or ``example_inputs`` break the contract (e.g. a mapping whose keys are not
            ``forward``'s first parameters: the message names the missing ones and the fix).

        Every ``TctuneError``'s message names this function's keywords (``timeout``, ``batch_sizes='8,,32'``),
        never the command's flags (:func:`api_message`); a ``UsageError``'s ``field`` stays the ``TuneConfig``
        field.
    """
    try:
        return _optimize(model, example_inputs, options)
    except TctuneError as exc:  # the library's messages name the command's flags: the caller typed keywords
        exc.args = (api_message(exc), *exc.args[1:])
        raise


def _optimize(model, example_inputs, options: dict):
    from .optimize import optimize as optimize_file, optimize_model
    from .search import TuneConfig

    if "example_inputs" in options:  # the documented name, given as a keyword: the same argument
        if example_inputs is not None:
            raise TypeError("tctune.optimize() got example_inputs twice (positionally and as a keyword)")
        example_inputs = options.pop("example_inputs")
    check_option_names(options, API_OPTIONS)  # before anything runs: a misspelt keyword is one error, at once
    keep_low = options.pop("keep_low_precision_outputs", None)
    if keep_low is not None:
        wanted = "compute" if keep_low else "fp32"
        if options.get("output_dtype", wanted) != wanted:
            raise UsageError(f"keep_low_precision_outputs={keep_low!r} asks for output_dtype {wanted!r}, but "
                             f"output_dtype={options['output_dtype']!r} is given\n  fix: give output_dtype only",
                             field="output_dtype")
        options["output_dtype"] = wanted
        keep_low = None  # the TunedModule follows the search's output_dtype
    if isinstance(model, (str, Path)):
        if isinstance(example_inputs, TuneConfig):
            if options:
                raise TypeError("tctune.optimize(path, cfg): give the options in the TuneConfig, not as keywords")
            return optimize_file(model, example_inputs)
        if example_inputs is not None:
            raise UsageError("a model file defines its own example_inputs(batch_size)\n  fix: tctune.optimize(path, "
                             "**options), or pass the module itself with its example inputs")
        folder = options.pop("calibration") if isinstance(options.get("calibration"), (str, Path)) else None
        extra = {k: options.pop(k) for k in API_OPTIONS if k in options}
        if extra:
            raise TypeError(f"{', '.join(extra)} are for a live module; a model file defines score() itself")
        from .modelfile import load_model_file

        mf = load_model_file(model)
        cfg = tune_config(options, out_dir=Path("tctune_out") / mf.name)
        if folder is not None:  # a folder of real batches, like --calibration PATH
            cfg = dataclasses.replace(cfg, calibration=str(folder))
        return _tuned(_in_api_words(lambda: optimize_model(mf, cfg), cfg.quiet), cfg, keep_low)
    return _optimize_module(model, example_inputs, options, keep_low)


def _optimize_module(model: torch.nn.Module, example_inputs: tuple | Callable | None, options: dict,
                     keep_low: bool):
    from .modelfile import ModelFile, example_batch
    from .optimize import optimize_model
    from .search.accuracy import check_score_options

    if example_inputs is None:
        raise UsageError("tctune.optimize(model, example_inputs): example inputs are needed to run the model\n"
                         "  fix: pass a tuple of tensors, or a function batch_size -> tuple of tensors")
    contract = {k: options.pop(k) for k in ("score", "calibration", "dynamic_shapes", "name") if k in options}
    if isinstance(example_inputs, Mapping) and isinstance(model, torch.nn.Module):  # inputs by argument name
        from .modelfile import forward_names, mapping_inputs

        label = contract.get("name") or type(model).__name__
        example_inputs = mapping_inputs(example_inputs, forward_names(model), f"{label}: example_inputs")
    folder = None
    if isinstance(contract.get("calibration"), (str, Path)):  # a folder of batches, like --calibration PATH
        folder = str(contract.pop("calibration"))
    mf = ModelFile.from_module(model, example_inputs, **contract)
    batch = None
    if not callable(example_inputs) or isinstance(example_inputs, torch.Tensor):
        b = example_batch(example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,))
        batch = (b,) if b else None
    # Every option is checked before a temporary folder is made: a rejected call leaves nothing behind.
    cfg = tune_config(options, out_dir=options.get("out") or "<temporary folder>", batch_sizes=batch)
    if folder is not None:
        cfg = dataclasses.replace(cfg, calibration=folder)
    if cfg.mode != "infer":
        raise UsageError("mode train needs example_targets and loss_fn: tune a model file for training\n"
                         "  fix: leave mode out (inference), or write a model file", field="mode")
    if cfg.devices and len(cfg.devices) > 1:
        raise UsageError("several devices start worker processes that load a model file; a live module cannot be "
                         "sent to them\n  fix: one device, or a model file", field="devices")
    check_score_options(mf, cfg)  # a score limit nothing would apply
    chosen = bool(options.get("out"))
    if not chosen:  # a folder the caller did not choose: made now, and said where it is
        cfg = dataclasses.replace(cfg, out_dir=tempfile.mkdtemp(prefix=f"tctune_{mf.name}_"))

    def run():
        if not chosen and not cfg.quiet:
            files = "report, study and ONNX files" if cfg.export else "report and study"
            log.warning("writing the %s to %s (a new temporary folder, not removed; choose the folder with "
                        "out=...)", files, cfg.out_dir)
        return optimize_model(mf, cfg)

    return _tuned(_in_api_words(run, cfg.quiet), cfg, keep_low)


def _tuned(optimized, cfg, keep_low: bool | None):
    """The :class:`~tctune.tuned.TunedModule` of a finished search; unless ``cfg.quiet``, the winner summary
    ``tctune optimize`` prints (:func:`tctune.report.console_summary`) goes to stdout first."""
    from .report import console_summary
    from .tuned import from_search

    report = getattr(optimized, "report", None) or {}
    if not cfg.quiet and report.get("best"):  # (no winner: from_search raises, saying why)
        print(api_words(console_summary(report, cfg.out_dir)), flush=True)
    return _with_out_dir(from_search(optimized, keep_low), cfg.out_dir)


def _with_out_dir(tuned, out_dir) -> Any:
    """``tuned`` (a ``TunedModule``) with ``out_dir``: the folder its search wrote its files to."""
    if isinstance(tuned, torch.nn.Module):
        tuned.out_dir = str(out_dir)
    return tuned


__all__ = ["API_OPTIONS", "KEYWORDS", "OPTIONS", "api_message", "check_option_names", "optimize", "tune_config"]
