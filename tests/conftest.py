"""Fixtures shared by several test files."""
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
