"""The ``tctune`` command: ``detect``, ``optimize``, ``inspect``, ``export`` and ``bench``.

One module per command (``tctune/cli/detect.py``, ``optimize.py``, ``engines.py``; ``inspect`` registers from
``tctune/inspect.py``), each with ``register(subparsers)`` and ``run(args) -> exit status``. Every error a user
can cause is printed as one message naming the cause and the fix (a library field named by its flag), with no
traceback unless ``--debug`` is given, and a non-zero exit status.
"""
from __future__ import annotations

import argparse
import logging
import sys

from .. import __version__
from .. import inspect as inspect_cmd
from ..console import console_handler
from ..errors import ModelFileError, TctuneError, UsageError
from . import detect, engines, optimize
from .common import flag_message, parse_batch_sizes, parse_devices, parse_fp8_keep, parse_runtimes

#: The command modules, in ``--help`` order.
COMMANDS = (detect, optimize, inspect_cmd, engines)


def _parser() -> tuple[argparse.ArgumentParser, dict]:
    """The argument parser and ``{command name: run function}``."""
    p = argparse.ArgumentParser(
        prog="tctune",
        description="Make a PyTorch model run fast on NVIDIA Tensor Cores, and prove it: detect the GPU, "
                    "rewrite the model's graph for it, search batch size x precision x passes by measuring, "
                    "export the winner.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"tctune {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    handlers = {}
    for mod in COMMANDS:
        names = mod.register(sub)
        for name in ([names] if isinstance(names, str) else names):
            handlers[name] = mod.run
    return p, handlers


def parser() -> argparse.ArgumentParser:
    """The ``tctune`` argument parser."""
    return _parser()[0]


def shadowing_note(package_file: str | None = None, cwd: str | None = None, env: dict | None = None) -> str | None:
    """Why the ``tctune`` that runs may not be the installed one, or None.

    ``python -m tctune`` puts the current folder first on ``sys.path``, so a ``tctune/`` package folder there (a
    clone's copy) is imported instead of the installed package. This returns one line when the running package
    (``package_file``: its ``__init__.py``, default this package's) lies directly in the current folder ``cwd``
    and another ``tctune`` is importable without it; None otherwise, and when ``PYTHONPATH`` (``env``, default
    ``os.environ``) names the current folder (a deliberate choice). A clone's root folder (no ``__init__.py``)
    does not shadow an installed package; without one, Python itself stops before this code runs
    ("No module named tctune.__main__").
    """
    import os
    from pathlib import Path

    here = Path(package_file or sys.modules["tctune"].__file__).resolve().parent
    folder = Path(cwd or os.getcwd()).resolve()
    env = os.environ if env is None else env
    if here.parent != folder or any(p and Path(p).resolve() == folder
                                    for p in env.get("PYTHONPATH", "").split(os.pathsep)):
        return None
    saved = sys.path[:]
    try:
        sys.path[:] = [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != folder]
        for finder in sys.meta_path:
            try:
                spec = finder.find_spec("tctune", None)
            except Exception:  # noqa: BLE001 - a finder that cannot answer is not evidence
                continue
            if spec is not None and spec.origin:
                other = Path(spec.origin).resolve().parent
                if other == here:
                    return None
                return (f"note: running the tctune in {here} (the current folder's tctune/ shadows the installed "
                        f"one in {other}); to run the installed one, run from another folder")
    finally:
        sys.path[:] = saved
    return None


def unknown_flags_message(sub: argparse.ArgumentParser, extra: list[str]) -> str:
    """argparse's "unrecognized arguments" for ``extra`` (what the command ``sub`` did not take), each unknown
    flag with the closest flag of ``sub`` (``--trails`` → ``did you mean --trials?``)."""
    from ..errors import did_you_mean

    flags = [s.removeprefix("--") for a in sub._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for token in extra:
        name = token.split("=", 1)[0]
        hint = did_you_mean(name.removeprefix("--"), flags, prefix="--") if name.startswith("--") else ""
        if hint:
            hints.append(f"{name}{hint}")
    # the arguments as given first (a flag's value stays beside it), then a suggestion per misspelt flag
    return "unrecognized arguments: " + " ".join(extra) + ("; " + "; ".join(hints) if hints else "")


def main(argv: list[str] | None = None) -> int:
    p, handlers = _parser()
    args, extra = p.parse_known_args(argv)
    if extra:  # argparse's own error, with the closest flag of the command for each misspelt one
        subs = next((a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction)), {})
        sub = subs.get(args.command) if args.command else None
        (sub or p).error(unknown_flags_message(sub or p, extra))
    if args.command is None:
        p.print_help()
        return 0
    quiet = getattr(args, "quiet", False)
    logger = logging.getLogger("tctune")  # our logger only: libraries (onnxscript, optuna) stay quiet
    if not logger.handlers:
        logger.addHandler(console_handler())
        logger.propagate = False
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    note = shadowing_note()
    if note:
        logger.warning(note)
    try:
        return handlers[args.command](args)
    except TctuneError as exc:
        if getattr(args, "debug", False):
            raise
        text = flag_message(exc) if isinstance(exc, UsageError) else str(exc)
        print(f"tctune: error: {text}", file=sys.stderr)
        return 2 if isinstance(exc, (UsageError, ModelFileError)) else 1  # 2: bad input; 1: nothing qualified or failed
    except KeyboardInterrupt:
        print("tctune: interrupted", file=sys.stderr)
        return 130


__all__ = ["main", "shadowing_note", "parse_batch_sizes", "parse_devices", "parse_fp8_keep", "parse_runtimes", "parser"]
