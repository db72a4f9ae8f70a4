"""Fixtures shared by several test files, and the per-worker thread count when pytest-xdist runs the suite."""
import os

import pytest

from zoo import TINY_MODEL_FILE, onnxruntime_or_skip


@pytest.fixture()
def tiny(tmp_path):
    """``tmp_path/tiny.py``: :data:`zoo.TINY_MODEL_FILE`, a model file for end-to-end runs."""
    f = tmp_path / "tiny.py"
    f.write_text(TINY_MODEL_FILE)
    return f


@pytest.fixture(scope="session")
def ort():
    """The ``onnxruntime`` module; a test that needs it skips without it (:func:`zoo.onnxruntime_or_skip`)."""
    return onnxruntime_or_skip()


def pytest_configure(config):
    """Under pytest-xdist (``-n N``), each worker's torch uses its share of the cores: N workers of the default
    thread count each would oversubscribe the machine and run slower than one process."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
