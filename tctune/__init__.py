"""tctune: make PyTorch models run fast on NVIDIA Tensor Cores, and prove it.

Public API (the CLI ``tctune`` wraps the same functions)::

    from tctune import optimize, save, load, TunedModule, TuneConfig, TrialParams, resolve, detect

``tctune.optimize`` is the function :func:`tctune.api.optimize` (a live module or a model file), also after the
submodule ``tctune.optimize`` (the command's pipeline) has been imported: import that submodule's names with
``from tctune.optimize import ...``.

Submodules load on first use: after ``import tctune``, ``tctune.backend.backend(precision="bf16")`` imports
``tctune.backend`` then.
"""
from __future__ import annotations

import sys
import types

__version__ = "0.1.0"

from .errors import (CandidateRejected, CaptureError, ExportError, HardwareError, ModelFileError,  # noqa: E402
                     PassError, TctuneError, UsageError)

#: Attributes that are functions here although a submodule of the same name exists (``tctune/optimize.py``):
#: importing the submodule would otherwise replace the function with the module.
_SHADOWED = ("optimize",)


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return  # the submodule stays in sys.modules; `tctune.optimize` stays the function
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name):  # lazy: keep `import tctune` (and `tctune --help`) fast
    if name == "optimize":
        from .api import optimize
        return optimize
    if name in ("save", "load", "TunedModule"):
        from . import tuned
        return getattr(tuned, name)
    if name == "TuneConfig":
        from .search import TuneConfig
        return TuneConfig
    if name == "TrialParams":
        from .trial import TrialParams
        return TrialParams
    if name in ("resolve", "detect"):
        from . import hardware
        return getattr(hardware, name)
    if not name.startswith("_"):  # a submodule, e.g. `tctune.backend.backend(...)` after a bare `import tctune`
        import importlib
        import importlib.util

        if importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["__version__", "optimize", "save", "load", "TunedModule", "TuneConfig", "TrialParams", "resolve", "detect",
           "TctuneError", "ModelFileError", "CaptureError", "PassError", "CandidateRejected", "ExportError",
           "HardwareError", "UsageError"]
