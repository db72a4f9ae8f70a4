"""benchmarks/compile_stages.py's CPU-side logic: the profile comparison of the two sides."""
from __future__ import annotations

import cProfile
import importlib.util
import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    spec = importlib.util.spec_from_file_location("compile_stages", os.path.join(ROOT, "benchmarks", "compile_stages.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Python-level work in each function's own frame: a shared callee (``time.sleep``, a helper) grows as much as its
# caller, and the order of such a tie is no test of the diff.
def _shared():
    end = time.perf_counter() + 0.01
    while time.perf_counter() < end:
        sum(range(200))


def _only_tctune():
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:
        sum(range(200))


def _profile(path, extra: bool) -> None:
    prof = cProfile.Profile()
    prof.enable()
    _shared()
    if extra:
        _only_tctune()
    prof.disable()
    prof.dump_stats(path)


def test_profile_diff_puts_the_function_only_one_side_runs_first(tmp_path):
    cs = _module()
    _profile(tmp_path / "a", extra=False)
    _profile(tmp_path / "b", extra=True)
    lines = cs.profile_diff(str(tmp_path / "a"), str(tmp_path / "b"), top=3).splitlines()
    assert lines[0].split()[0] == "+s"
    assert "_only_tctune" in lines[1] and "0.00/0" in lines[1]  # absent on the Inductor side
    assert float(lines[1].split()[0]) >= 0.04
    assert "_shared" not in lines[1]
