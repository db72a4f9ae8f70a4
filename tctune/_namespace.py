"""Why ``tctune`` may be an empty namespace package, for ``python -m tctune`` (``tctune/__main__.py``).

From a folder that holds a folder named ``tctune`` with no ``__init__.py`` (a clone of this repository named
``tctune``), Python's path finder resolves ``import tctune`` to that folder as a namespace package when no
*path entry* holds the real package — e.g. under an editable install made before ``pyproject.toml`` mapped the
packages to the project root (``package-dir``): its import hook comes after the path finder; the install made
now is a path entry (the project root), where the regular package wins over the namespace folder. Nothing of tctune's ``__init__.py`` runs then (``tctune.load`` is missing), but ``python -m tctune`` still
reaches ``__main__.py`` through the installed package: this module names the cause there. It imports nothing
from tctune, so it runs when the package's ``__init__.py`` did not.
"""
from __future__ import annotations

import sys


def namespace_error(module=None) -> str | None:
    """One error message (cause, then ``fix:``) when ``module`` (default ``sys.modules["tctune"]``) is a namespace
    package (no ``__file__``: its ``__init__.py`` never ran), else None."""
    module = sys.modules.get("tctune") if module is None else module
    if module is None or getattr(module, "__file__", None):
        return None
    folders = ", ".join(str(p) for p in getattr(module, "__path__", [])) or "a folder without __init__.py"
    return (f"`import tctune` found {folders}, a folder named tctune with no __init__.py (the root of a clone "
            "named tctune?), instead of the tctune package, so tctune's functions are missing\n"
            "  fix: run from another folder (inside the clone, or any folder that does not hold a tctune/ folder), "
            "or rename the clone's folder, or run `pip install -e` on the clone again (an editable install of "
            "this version is a plain path entry, which finds the package from here too)")
