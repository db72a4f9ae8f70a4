"""tctune: make PyTorch models run fast on NVIDIA Tensor Cores, and prove it.

Public API (the CLI ``tctune`` wraps the same functions)::

    from tctune import optimize, TuneConfig, TrialParams, resolve, detect
"""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import (CandidateRejected, CaptureError, ExportError, HardwareError, ModelFileError,  # noqa: E402
                     PassError, TctuneError, UsageError)


def __getattr__(name):  # lazy: keep `import tctune` (and `tctune --help`) fast
    if name in ("optimize",):
        from .optimize import optimize
        return optimize
    if name == "TuneConfig":
        from .search import TuneConfig
        return TuneConfig
    if name == "TrialParams":
        from .trial import TrialParams
        return TrialParams
    if name in ("resolve", "detect"):
        from . import hardware
        return getattr(hardware, name)
    raise AttributeError(name)


__all__ = ["__version__", "optimize", "TuneConfig", "TrialParams", "resolve", "detect", "TctuneError", "ModelFileError",
           "CaptureError", "PassError", "CandidateRejected", "ExportError", "HardwareError", "UsageError"]
