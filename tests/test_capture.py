"""tctune.capture: dynamic batch, a batch range narrowed by the model, and a batch the model fixes."""
from __future__ import annotations

import pytest
import torch

from tctune.capture import MAX_BATCH, batch_range, capture
from tctune.errors import CaptureError


class _Bounded(torch.nn.Module):
    """Bounds the batch below MAX_BATCH, as an op's 32-bit indexing check on a big image batch can."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        torch._check(x.shape[0] <= 1000)
        return self.fc(x)


class _Fixed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).view(4, 8)  # hard-coded batch


def test_plain_model_gets_full_dynamic_batch():
    gm = capture(torch.nn.Linear(8, 8).eval(), (torch.randn(4, 8),))
    assert batch_range(gm) == (1, MAX_BATCH)
    x = torch.randn(9, 8)
    torch.testing.assert_close(gm(x), torch.nn.functional.linear(x, gm.weight, gm.bias))


def test_bounded_batch_is_narrowed_not_refused():
    model = _Bounded().eval()
    gm = capture(model, (torch.randn(4, 8),))
    assert batch_range(gm) == (1, 1000)
    for b in (1, 7, 1000):  # batch 1 kept by the re-export with the narrowed max
        x = torch.randn(b, 8)
        torch.testing.assert_close(gm(x), model(x))


class _Hole(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[0] == 32:  # one batch size takes another path: not a range
            return self.fc(x) * 2
        return self.fc(x)


def test_branch_on_one_batch_size_is_not_captured():
    with pytest.raises(CaptureError, match="fixes the batch size"):
        capture(_Hole().eval(), (torch.randn(4, 8),))


def test_fixed_batch_is_one_clear_error():
    with pytest.raises(CaptureError, match=r"fixes the batch size.*\n.*fix: use x.shape\[0\] or -1"):
        capture(_Fixed().eval(), (torch.randn(4, 8),))


def test_search_skips_graph_candidates_outside_the_range(tmp_path):
    from tctune.search import Tuner, TuneConfig
    from tctune.hardware import resolve
    from tctune.modelfile import load_model_file

    src = tmp_path / "bounded.py"
    src.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        torch._check(x.shape[0] <= 16)\n"
        "        return self.fc(x)\n"
        "def build_model():\n    return M()\n"
        "def example_inputs(batch_size):\n    return (torch.randn(batch_size, 8),)\n"
    )
    mf = load_model_file(src)
    tuner = Tuner(TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(8, 32)), mf, resolve(None),
                  device=torch.device("cpu"))
    assert tuner.captured.ok, tuner.captured.reason
    import optuna

    study = optuna.create_study()
    base = {"precision": "fp32", "graph_passes": True, "runtime": "eager"}
    assert tuner.skip_reason(study, {"batch_size": 8, **base}) is None
    reason = tuner.skip_reason(study, {"batch_size": 32, **base})
    assert reason and "batch 1..16" in reason
    assert tuner.skip_reason(study, {"batch_size": 32, **base, "graph_passes": False}) is None


class _VarArgs(torch.nn.Module):
    """``forward(self, *args)``, as wrappers that pass positional tensors on as keywords are written."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(4, 16)

    def forward(self, *args):
        return self.a(args[0]) + self.b(args[1])


class _FirstThenVarArgs(_VarArgs):
    def forward(self, x, *rest):
        return self.a(x) + self.b(rest[0])


@pytest.mark.parametrize("cls", [_VarArgs, _FirstThenVarArgs])
def test_forward_with_star_args_is_captured_with_a_dynamic_batch(cls):
    """torch.export wants the specs of a ``*args`` parameter as one tuple at its place; a flat tuple made every
    capture of such a model fail ("inputs[0] is a tuple, but dynamic_shapes[0] is a dict"), so no graph pass
    ran on it (a Hugging Face wrapper taking ``*args``, found by the zoo's ``tctune optimize`` on BERT)."""
    model = cls().eval()
    gm = capture(model, (torch.randn(3, 8), torch.randn(3, 4)))
    for batch in (1, 5):  # fresh inputs at other batch sizes
        x = (torch.randn(batch, 8), torch.randn(batch, 4))
        torch.testing.assert_close(gm(*x), model(*x))
    assert batch_range(gm)[1] > 5


class _NoneThroughVarArgs(_VarArgs):
    def forward(self, x, *args, **kwargs):
        return self.a(x)


def test_forward_with_star_args_that_receive_nothing_is_captured():
    """``forward(x, *args, **kwargs)`` called with ``x`` alone: no spec goes to ``*args`` (an empty tuple there
    made export refuse the flat inputs)."""
    model = _NoneThroughVarArgs().eval()
    gm = capture(model, (torch.randn(3, 8),))
    x = torch.randn(6, 8)
    torch.testing.assert_close(gm(x), model(x))


class _Box:
    """Holds a tensor; not registered with torch.utils._pytree."""

    def __init__(self, t):
        self.t = t


class _ReturnsBox(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x), _Box(x)


def test_output_of_an_unknown_type_names_the_type_and_the_fix():
    with pytest.raises(CaptureError) as info:
        capture(_ReturnsBox().eval(), (torch.randn(4, 8),))
    text = str(info.value)
    assert "_Box" in text and "cause: the model's output holds" in text
    assert "fix: return tensors" in text and "register_pytree_node" in text
    first = text.splitlines()[0]
    assert len(first) < 420 and (first.endswith(".") or first.endswith(" ...")), first  # never cut mid-word


def test_hugging_face_kv_cache_output_says_use_cache_false():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(CaptureError, match=r"(?s)KV cache.*fix: build the model with use_cache=False"):
        capture(model, (ids,))
    model.config.use_cache = False  # the fix the message names
    out = capture(model, (ids,))(ids)
    torch.testing.assert_close(out["logits"], model(ids).logits)


@pytest.mark.parametrize("line,expect", [
    ("short message", "short message"),
    ("a " * 75 + "end. " + "word " * 100, "a " * 75 + "end. ..."),
    ("x" * 50 + " " + "longword" * 60, "x" * 50 + " ..."),
])
def test_clip_cuts_at_a_sentence_or_word_end(line, expect):
    from tctune.errors import clip
    assert clip(line) == expect


class _VarArgs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, *rest):
        return self.fc(x) + rest[0].sum(1, keepdim=True)


def test_dynamic_shapes_keyed_by_the_varargs_name():
    """{"rest": (spec, ...)} for the inputs forward's *rest takes, as torch.export reads it."""
    from tctune.capture import normalize_dynamic_shapes

    seq = torch.export.Dim("seq", min=2, max=64)
    model = _VarArgs().eval()
    inputs = (torch.randn(4, 8), torch.randn(4, 16))
    gm = capture(model, inputs, {"x": None, "rest": ({1: seq},)})
    y = torch.randn(3, 40)  # another batch and another length of the *rest input
    torch.testing.assert_close(gm(inputs[0][:3], y), model(inputs[0][:3], y))
    with pytest.raises(ValueError, match=r"one entry for each of the 1 input\(s\) forward's \*rest takes"):
        normalize_dynamic_shapes({"rest": ({1: seq}, {})}, inputs, ["x"], "rest")
    with pytest.raises(ValueError, match=r"go under 'rest', one entry each: \{'rest': \(\{\},\)\}"):
        normalize_dynamic_shapes({"y": {1: seq}}, inputs, ["x"], "rest")
    with pytest.raises(ValueError, match=r"it has none before \*args"):
        normalize_dynamic_shapes({"x": {1: seq}}, inputs, [], "args")
