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
from ..errors import ModelFileError, TctuneError, UsageError
from . import detect, engines, optimize
from .common import StderrHandler, flag_message, parse_batch_sizes, parse_devices, parse_fp8_keep, parse_runtimes

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


def main(argv: list[str] | None = None) -> int:
    p, handlers = _parser()
    args = p.parse_args(argv)
    if args.command is None:
        p.print_help()
        return 0
    quiet = getattr(args, "quiet", False)
    logger = logging.getLogger("tctune")  # our logger only: libraries (onnxscript, optuna) stay quiet
    if not logger.handlers:
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("tctune: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
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


__all__ = ["main", "parse_batch_sizes", "parse_devices", "parse_fp8_keep", "parse_runtimes", "parser"]
