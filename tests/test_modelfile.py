"""The model-file contract: good files load, each bad file gets one clear error."""
import textwrap
from collections.abc import Mapping

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


def test_raising_on_import_names_the_line_for_a_relative_path(tmp_path, monkeypatch):
    """`tctune optimize model.py` from the file's folder: the line is named there too."""
    f = write(tmp_path, "import torch\nSIZE = int('16x')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelFileError, match="raised ValueError at line 2 while being imported"):
        load_model_file(f.name)


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
    ("return {'x': torch.randn(batch_size, 4)}", r"\(2\): 'x' not among forward's positional arguments \(input\)"),
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


# --- inputs by forward's argument names (a dict, a tokenizer's BatchEncoding) --------------------------------

class _Encoding(Mapping):
    """A read-only mapping like a tokenizer's ``BatchEncoding``: not a dict, keys in its own order."""

    def __init__(self, **tensors):
        self._data = tensors

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


class _Text(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, token_type_ids=None, *, labels=None, **kwargs):
        pass


NAMES = ["input_ids", "attention_mask", "token_type_ids"]


@pytest.mark.parametrize("make", [dict, _Encoding])
def test_a_mapping_is_ordered_by_forwards_parameters_not_by_its_own_order(make):
    from tctune.modelfile import forward_names, mapping_inputs

    ids, mask, types = torch.randint(0, 9, (2, 5)), torch.randint(0, 2, (2, 5)), torch.randint(0, 2, (2, 5))
    assert forward_names(_Text()) == NAMES  # positional parameters only: not labels, not **kwargs
    got = mapping_inputs(make(token_type_ids=types, attention_mask=mask, input_ids=ids), NAMES, "M: example_inputs")
    assert len(got) == 3 and all(a is b for a, b in zip(got, (ids, mask, types)))
    got = mapping_inputs(make(attention_mask=mask, input_ids=ids), NAMES, "M: example_inputs")  # a prefix
    assert len(got) == 2 and got[0] is ids and got[1] is mask


@pytest.mark.parametrize("inputs,names,said", [
    ({}, NAMES, "M: example_inputs is an empty dict\n  fix: map forward's argument names to tensors"),
    ({"input_ids": torch.ones(2, 3)}, [], "M: example_inputs is a dict of named inputs (input_ids), but forward "
                                          "names no positional argument (forward(*args, **kwargs))"),
    ({"input_ids": torch.ones(2, 3), "labels": torch.ones(2)}, NAMES,
     "M: example_inputs: 'labels' not among forward's positional arguments (input_ids, attention_mask, "
     "token_type_ids); tctune passes inputs by position\n  fix: key the tensors by those names"),
    ({"input_ids": torch.ones(2, 3), "token_type_ids": torch.ones(2, 3)}, NAMES,
     "M: example_inputs gives input_ids, token_type_ids but not attention_mask, which forward takes before "
     "'token_type_ids'"),
    ({"input_ids": [[1, 2]], "attention_mask": torch.ones(1, 2)}, NAMES,
     "M: example_inputs: 'input_ids' is a list, not a tensor\n  fix: tensors only"),
])
def test_a_mapping_that_cannot_be_put_in_forwards_order_is_one_error_naming_the_keys(inputs, names, said):
    from tctune.modelfile import mapping_inputs

    with pytest.raises(ModelFileError) as info:
        mapping_inputs(inputs, names, "M: example_inputs")
    assert str(info.value).startswith(said) and "\n  fix: " in str(info.value)


def test_a_skipped_parameter_names_the_wrapper_that_fixes_it():
    from tctune.modelfile import mapping_inputs

    with pytest.raises(ModelFileError) as info:
        mapping_inputs({"input_ids": torch.ones(1, 2), "attention_mask": torch.ones(1, 2)},
                       ["input_ids", "past_key_values", "attention_mask"], "M: example_inputs")
    assert str(info.value).endswith("fix: give past_key_values too, or wrap the model in a module whose forward takes "
                                    "only these inputs, e.g. def forward(self, input_ids, attention_mask): return "
                                    "self.model(input_ids=input_ids, attention_mask=attention_mask)")


MAPPING_FILE = """
import torch

class Text(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 4)

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        return (self.emb(input_ids) * attention_mask.unsqueeze(-1)).sum(1)

def build_model():
    return Text()

def _batch(b):
    return {"attention_mask": torch.randint(0, 2, (b, 6)), "input_ids": torch.randint(0, 16, (b, 6))}

def example_inputs(batch_size):
    return _batch(batch_size)

def calibration_inputs():
    return [_batch(3), _batch(5)]
"""


def test_a_model_file_may_give_its_inputs_and_calibration_batches_by_name(tmp_path):
    from tctune.calibration import from_model_file

    mf = load_model_file(write(tmp_path, MAPPING_FILE))
    ids, mask = mf.inputs(3)
    assert ids.shape == mask.shape == (3, 6) and ids.max() > 1 and mask.max() <= 1  # forward's order, not the dict's
    batches = from_model_file(mf, mf.inputs(2))
    assert [b.inputs[0].shape[0] for b in batches] == [3, 5] and all(b.inputs[1].max() <= 1 for b in batches)


def test_a_nested_tuple_input_and_a_keyword_only_argument_name_the_wrapper_fix(tmp_path):
    """forward(self, pair) fed a tuple, and forward(x, *, scale) fed {"x", "scale"}: each one error whose fix is a
    wrapper module taking the tensors by position (was "got (tuple)" / "key the tensors by those names")."""
    from tctune.errors import ModelFileError
    from tctune.modelfile import load_model_file

    pair = tmp_path / "pair.py"
    pair.write_text("import torch\nclass M(torch.nn.Module):\n    def forward(self, p):\n        return p[0] + p[1]\n"
                    "def build_model():\n    return M()\n"
                    "def example_inputs(b):\n    return ((torch.randn(b, 4), torch.randn(b, 4)),)\n")
    with pytest.raises(ModelFileError, match=r"input 0 is a tuple of tensors, not a tensor(.|\n)*"
                                             r"def forward\(self, a, b\): return self.model\(\(a, b\)\)"):
        load_model_file(pair).inputs(2)
    kw = tmp_path / "kw.py"
    kw.write_text("import torch\nclass M(torch.nn.Module):\n    def forward(self, x, *, scale):\n"
                  "        return x * scale\ndef build_model():\n    return M()\n"
                  "def example_inputs(b):\n    return {'x': torch.randn(b, 4), 'scale': torch.randn(b, 4)}\n")
    with pytest.raises(ModelFileError, match=r"'scale' not among(.|\n)*keyword-only(.|\n)*"
                                             r"def forward\(self, x, scale\): return self.model\(x, scale=scale\)"):
        load_model_file(kw).inputs(2)


def test_an_error_in_build_model_names_the_model_files_line(tmp_path):
    from tctune.errors import ModelFileError
    from tctune.modelfile import load_model_file

    f = tmp_path / "typo.py"
    f.write_text("import torch\ndef build_model():\n    return torch.nn.Sequentail(torch.nn.Linear(8, 8))\n"
                 "def example_inputs(b):\n    return (torch.randn(b, 8),)\n")
    with pytest.raises(ModelFileError) as info:
        load_model_file(f).model()
    lines = str(info.value).splitlines()
    assert lines[0].startswith("typo.py: build_model() raised AttributeError")
    assert lines[1] == f"  at {f}:3 in build_model: return torch.nn.Sequentail(torch.nn.Linear(8, 8))"
