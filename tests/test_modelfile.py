"""The model-file contract: good files load, each bad file gets one clear error."""
import textwrap

import pytest
import torch

from tctune.errors import ModelFileError
from tctune.modelfile import load_model_file

GOOD = """
import torch
def build_model():
    return torch.nn.Linear(4, 3)
def example_inputs(batch_size):
    return (torch.randn(batch_size, 4),)
"""


def write(tmp_path, text, name="model.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_good_file_loads_and_builds(tmp_path):
    mf = load_model_file(write(tmp_path, GOOD))
    assert mf.name == "model"
    assert isinstance(mf.model(), torch.nn.Module)
    (x,) = mf.inputs(5)
    assert x.shape == (5, 4)
    assert mf.score is None and mf.loss_fn is None


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        load_model_file(tmp_path / "nope.py")


def test_not_python(tmp_path):
    with pytest.raises(ModelFileError, match="not a Python file"):
        load_model_file(write(tmp_path, "hello", name="model.txt"))


def test_syntax_error_names_line(tmp_path):
    with pytest.raises(ModelFileError, match=r"line 3: syntax error"):
        load_model_file(write(tmp_path, "import torch\n\ndef build_model(:\n    pass\n"))


def test_raising_on_import(tmp_path):
    with pytest.raises(ModelFileError, match="raised ZeroDivisionError at line 2"):
        load_model_file(write(tmp_path, "import torch\nx = 1 / 0\n"))


def test_missing_build_model_shows_signature(tmp_path):
    with pytest.raises(ModelFileError, match=r"(?s)does not define build_model\(\).*def build_model\(\) -> torch.nn.Module"):
        load_model_file(write(tmp_path, "def example_inputs(b):\n    return ()\n"))


def test_not_callable(tmp_path):
    with pytest.raises(ModelFileError, match="example_inputs is a int, not a function"):
        load_model_file(write(tmp_path, "def build_model():\n    pass\nexample_inputs = 3\n"))


def test_a_score_that_is_not_a_function_names_the_contract(tmp_path):
    with pytest.raises(ModelFileError, match=r"score is a float, not a function\n  expected: def score\(model: "
                                             r"torch.nn.Module\) -> float \(higher is better\)"):
        load_model_file(write(tmp_path, GOOD + "\nscore = 0.9\n"))


def test_build_model_wrong_type(tmp_path):
    mf = load_model_file(write(tmp_path, GOOD.replace("return torch.nn.Linear(4, 3)", "return 42")))
    with pytest.raises(ModelFileError, match="must return a torch.nn.Module, got int"):
        mf.model()


@pytest.mark.parametrize("body,match", [
    ("return [1, 2]", r"tuple of tensors, got \(int, int\)"),
    ("return {'x': torch.randn(batch_size, 4)}", "tuple of tensors, got dict"),
    ("return (torch.randn(3, 4),)", "dim 0 must be the batch"),
    ("return ()", "tuple of tensors"),
])
def test_example_inputs_wrong_return(tmp_path, body, match):
    mf = load_model_file(write(tmp_path, GOOD.replace("return (torch.randn(batch_size, 4),)", body)))
    with pytest.raises(ModelFileError, match=match):
        mf.inputs(5)


def test_single_tensor_is_accepted_as_tuple(tmp_path):
    mf = load_model_file(write(tmp_path, GOOD.replace("return (torch.randn(batch_size, 4),)", "return torch.randn(batch_size, 4)")))
    assert len(mf.inputs(2)) == 1


@pytest.mark.parametrize("ret,n", [("[torch.randn(batch_size, 4), torch.randn(batch_size, 2)]", 2),
                                   ("torch.randn(batch_size, 4)", 1)])
def test_example_inputs_list_or_one_tensor_is_taken_as_the_tuple(tmp_path, ret, n):
    """The contract accepts a list of tensors (the same tuple) or one tensor (a 1-tuple), shapes checked alike."""
    mf = load_model_file(write(tmp_path, f"""
        import torch
        def build_model():
            return torch.nn.Linear(4, 3)
        def example_inputs(batch_size):
            return {ret}
        """))
    inputs = mf.inputs(5)
    assert type(inputs) is tuple and len(inputs) == n and all(t.shape[0] == 5 for t in inputs)
    assert mf.batched_mask() == (True,) * n
    assert mf.model()(inputs[0]).shape == (5, 3)


def test_example_inputs_list_of_non_tensors_names_what_it_got(tmp_path):
    mf = load_model_file(write(tmp_path, """
        import torch
        def build_model():
            return torch.nn.Linear(4, 3)
        def example_inputs(batch_size):
            return [torch.randn(batch_size, 4), 3]
        """))
    with pytest.raises(ModelFileError, match=r"must return a tuple of tensors, got \(Tensor, int\) \(a list of "
                                             r"tensors or one tensor is accepted too\)"):
        mf.inputs(5)
