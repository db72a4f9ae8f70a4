"""Loading a Python file by its path, shared by the benchmark scripts and the tests.

``benchmarks/`` is a folder of scripts, not a package: a script loads another (``zoo_profile.py`` loads
``zoo.py``) or a recipe (``recipes/bert_base.py``) by path. A script run by path (``python benchmarks/x.py``) has
its own folder first on ``sys.path``, so ``from benchload import load_benchmark`` finds this file; the tests load
it by path once (``tests/zoo.py``) and register it under the same name.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

#: This folder (``benchmarks/``) and the repository root.
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def load_module(name: str, path: str | Path) -> ModuleType:
    """The Python file ``path`` as module ``name``, registered in ``sys.modules`` (a module's dataclasses and
    Dynamo look their module up there) and loaded once per process: a later call with the same ``name`` returns
    the module already there. A file that raises while loading is taken out of ``sys.modules`` again.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        Exception: whatever running the file raises.
    """
    if name in sys.modules:
        return sys.modules[name]
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no Python file {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def load_benchmark(stem: str) -> ModuleType:
    """``benchmarks/<stem>.py`` as module ``tctune_bench_<stem>`` (:func:`load_module`): the scripts and the tests
    load each other under these names, so they share one module object (``zoo.py`` is ``tctune_bench_zoo``)."""
    return load_module(f"tctune_bench_{stem}", HERE / f"{stem}.py")


__all__ = ["HERE", "ROOT", "load_benchmark", "load_module"]
